"""Downstream evaluation: log-likelihoods of continuations from a built-in decoder, and tasks scored by them."""
