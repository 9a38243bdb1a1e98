"""Drawing the communication graph: DOT, SVG, and the interactive HTML page."""
