"""Generation engines behind one protocol (`hf` default), multi-turn agent loop and tools."""
