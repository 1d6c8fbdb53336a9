"""The prompt and plan contract: layout with serving positions, memory plans and their signatures,
recovery policies, encoding plans, the memory chain's link keys."""
