"""A kit for policy authors: views built by hand, and the properties every policy must keep."""
