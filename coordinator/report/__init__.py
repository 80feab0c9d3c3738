"""After a run: `compare.py` (tables and plots across run directories, `dropfl report`) and `reproduce.py`
(published tables re-run and set beside the paper's, `dropfl reproduce`)."""
