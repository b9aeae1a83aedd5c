"""kvxfer.bench."""
