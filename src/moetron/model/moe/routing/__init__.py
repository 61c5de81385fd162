"""Routing: which experts each token goes to, with what weight."""
