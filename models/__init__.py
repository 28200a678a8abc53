from models.gpt import GPT, flops_per_token, init_weights, lm_loss_sum

__all__ = ["GPT", "flops_per_token", "init_weights", "lm_loss_sum"]
