"""Flower server side: one Strategy per method family, thin over the math in ``pflalign``."""

from pflalign.runtime import set_flower_environment

set_flower_environment()
