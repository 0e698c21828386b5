"""The Hugging Face Hub side of a checkpoint.

    model_card   the README.md model card written into every checkpoint (templates: `model_cards`)
    push         pushing a saved checkpoint, synchronously with retries or from a background thread
    callbacks    Trainer callbacks: the card at every save, and the push of each save
"""
