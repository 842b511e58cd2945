"""`adaptive`: the goodput-aware placement policy and its parts."""
