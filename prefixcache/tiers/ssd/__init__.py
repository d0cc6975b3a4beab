"""tiers.ssd"""
