"""The built-in demo model (`engine serve` without a model) and the maker of seeded random
checkpoints and tokenizers it is built with, which tools/data/make_model.py and the tests use too.
Kept out of engine/model/: nothing here runs a model."""
