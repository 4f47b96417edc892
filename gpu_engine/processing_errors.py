"""The one error type of prompt building: bad media or messages, or processor configs that cannot work."""


class ProcessorError(ValueError):
    """Bad media or messages, or processor configs that cannot work; the message says which input and why."""
