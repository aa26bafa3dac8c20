"""Training objectives: how records become tokens, losses and evaluation metrics.

``text_format`` turns records into model text (prompts, control codes); ``encoding`` tokenises
prompt/completion pairs with loss masks and pads batches; ``generation`` runs batched beam
search for evaluation.
"""
