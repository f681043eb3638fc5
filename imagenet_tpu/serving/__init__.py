"""After training: the SavedModel export (images in, named top-5 classes out; loads without this package)."""
