"""trident: GPT pretraining with data, tensor and pipeline parallelism in plain PyTorch."""
