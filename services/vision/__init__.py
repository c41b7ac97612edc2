"""The vision service: image bytes -> leased references to projected features."""
