"""The neutral checkpoint model every command consumes: logical tensors made of byte ranges in files, the run's
scalars and the parallel layout it was saved with. Format-specific facts stay in the layouts that read them."""
