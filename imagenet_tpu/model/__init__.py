"""The model: the ResNet, replica-group batch norm and its inference statistics, the Keras Classifier (train and
test steps, loss, metrics)."""
