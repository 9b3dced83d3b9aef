"""Supervised fine-tuning jobs (TRL's SFTTrainer): the spec, the data checks, the chat template
with assistant masks, the job, and chats generated from a game's own prompts."""
