"""Serving past one engine: replicas on Ray Serve (`ray_serve`, an optional extra)."""
