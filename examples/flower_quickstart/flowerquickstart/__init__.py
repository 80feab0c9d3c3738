"""flowerquickstart: Flower's PyTorch quickstart on a dropfl federation."""
