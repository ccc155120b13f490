"""The multi-turn demo's conversation: its opening and follow-up messages and how a next turn's prompt is made
(``chm hymcache chat``, in process and on ``vllm serve``, and the tests that replay its turns)."""

OPENINGS = ("What is the capital of France?", "Name a fruit that is yellow.", "What colour is the sky on a clear day?",
            "How many legs does a spider have?")
FOLLOW_UPS = ("And of Spain?", "Tell me one more.", "Why is that?", "Say it in one word.", "Thanks. Anything else?")


def next_turn_prompt(context: list[int], answer: list[int], user_text: str, tokenizer) -> list[int]:
    """The previous turn's prompt and answer, then the next user message in SmolLM2's chat template."""
    ended = bool(answer) and answer[-1] == tokenizer.eos_id  # the answer closed its own turn
    text = ("" if ended else "<|im_end|>") + f"\n<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"
    return context + answer + tokenizer.encode(text)
