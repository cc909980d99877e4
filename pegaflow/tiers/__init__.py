"""The tiers below L1, each behind the one `Tier` protocol (tiers.protocol):
the SSD tier, SSD→GPU direct reads, and peers on other nodes (remote/)."""
