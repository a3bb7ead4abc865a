"""Live objects <-> state trees."""
