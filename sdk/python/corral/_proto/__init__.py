"""Generated protobuf messages of corral.v1 (private: see generate.py)."""
