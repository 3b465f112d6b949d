"""The commands as library functions over the neutral model: consolidate, reshard, verify, inspect, push, and
the Hugging Face folder and PEFT adapter writers they share."""
