"""Vision workloads: ResNet-18 (CIFAR variant) on CIFAR-10."""
