"""Production request traces (Mooncake JSONL, BurstGPT CSV): reading them, their length and
arrival statistics, and the prefix reuse an LRU cache of any size would have delivered."""
