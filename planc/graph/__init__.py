"""The communication graph: its typed schema, the layout algebra, the derivation."""
