"""Built-in backends, one folder each; they register as `kvcached.backends` entry points."""
