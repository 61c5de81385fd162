"""`moetron quickstart`: the built-in corpus (`corpus.py`) and the steps from text to a trained model (`pipeline.py`)."""
