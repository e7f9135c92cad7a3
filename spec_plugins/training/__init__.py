"""Self-distillation training for the draft heads (``spec-plugins train {medusa,eagle}``)."""
