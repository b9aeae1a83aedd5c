"""kvxfer.gpu."""
