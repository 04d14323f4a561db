"""optax's Newton-Schulz orthogonalisation, which optax.contrib exports only inside its Muon (the module is
private, and its name may move between optax releases)."""

from optax.contrib._muon import orthogonalize_via_newton_schulz

__all__ = ["orthogonalize_via_newton_schulz"]
