"""Flower ClientApp side: Message in, a local-training call into ``pflalign``, Message out."""

from pflalign.runtime import set_flower_environment

set_flower_environment()
