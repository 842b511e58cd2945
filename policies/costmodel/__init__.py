"""The stage-time cost model: hardware priors, roofline estimates and their online calibration."""

from policies.native import activate as _activate

_activate(__path__, __name__)
