"""`moetron quickstart`: the built-in corpus (`corpus.py`) and the steps to a trained model (`pipeline.py`)."""
