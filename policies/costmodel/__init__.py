"""The stage-time cost model: hardware priors, roofline estimates and their online calibration."""
