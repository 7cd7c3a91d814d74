"""Factual-recall probe: greedy cloze completion accuracy of a causal LM."""

from __future__ import annotations

import inspect
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

_STRIP = string.whitespace + string.punctuation
_SLACK = 2  # extra tokens allowed for leading whitespace/punctuation, e.g. ' "'


# Cloze prompts (plain completion style) with one-word answers. SmolLM2-135M-Instruct (GGUF Q4_1
# dequantised to float32) gets 85/135 = 0.63 of them right, so damage is visible in both directions.
FACTS: list[tuple[str, str]] = [
    # Geography
    ("The capital of France is", "Paris"),
    ("The capital of Japan is", "Tokyo"),
    ("The capital of Italy is", "Rome"),
    ("The capital of Germany is", "Berlin"),
    ("The capital of Spain is", "Madrid"),
    ("The capital of Russia is", "Moscow"),
    ("The capital of England is", "London"),
    ("The capital of Egypt is", "Cairo"),
    ("The capital of Greece is", "Athens"),
    ("The capital of China is", "Beijing"),
    ("The capital of Canada is", "Ottawa"),
    ("The capital of Australia is", "Canberra"),
    ("The capital of Portugal is", "Lisbon"),
    ("The capital of Kenya is", "Nairobi"),
    ("The capital of Norway is", "Oslo"),
    ("The capital of Poland is", "Warsaw"),
    ("The capital of Turkey is", "Ankara"),
    ("The capital of Argentina is", "Buenos"),
    ("The Eiffel Tower is located in the city of", "Paris"),
    ("The Statue of Liberty stands in the city of New", "York"),
    ("The longest river in Africa is the", "Nile"),
    ("The largest ocean on Earth is the", "Pacific"),
    ("The tallest mountain in the world is Mount", "Everest"),
    ("The largest desert in Africa is the", "Sahara"),
    ("The Great Wall is a famous landmark in", "China"),
    ("The pyramids of Giza are located in the country of", "Egypt"),
    ("The kangaroo is a national symbol of", "Australia"),
    ("Brazil is a country on the continent of South", "America"),
    ("The country with the largest population in South America is", "Brazil"),
    ("The official language of Brazil is", "Portuguese"),
    ("The currency of Japan is the", "yen"),
    ("Sydney is a large city in", "Australia"),
    ("Most of the Amazon rainforest lies within the country of", "Brazil"),
    ("Mount Kilimanjaro is the highest mountain on the continent of", "Africa"),
    # Science
    ("Water is made of hydrogen and", "oxygen"),
    ("The chemical symbol for gold is", "Au"),
    ("The chemical symbol for sodium is", "Na"),
    ("The chemical symbol for iron is", "Fe"),
    ("The chemical formula for water is", "H2O"),
    ("Plants absorb carbon dioxide and release", "oxygen"),
    ("The planet closest to the Sun is", "Mercury"),
    ("The largest planet in our solar system is", "Jupiter"),
    ("The Red Planet is another name for", "Mars"),
    ("The Earth revolves around the", "Sun"),
    ("The natural satellite of the Earth is the", "Moon"),
    ("Water freezes at a temperature of zero degrees", "Celsius"),
    ("The force that pulls objects toward the Earth is called", "gravity"),
    ("The powerhouse of the cell is the", "mitochondria"),
    ("The organ that pumps blood through the body is the", "heart"),
    ("Humans breathe with their", "lungs"),
    ("The hardest natural substance is", "diamond"),
    ("In a thunderstorm you see the lightning before you hear the", "thunder"),
    ("The process by which plants make food from sunlight is called", "photosynthesis"),
    ("Humans breathe in oxygen and breathe out carbon", "dioxide"),
    ("The study of living things is called", "biology"),
    ("The theory of relativity was developed by Albert", "Einstein"),
    ("A molecule of table salt is made of sodium and", "chlorine"),
    ("The number of bones in the adult human body is about", "206"),
    ("The speed of light is about 300,000 kilometres per", "second"),
    # History
    ("The first President of the United States was George", "Washington"),
    ("World War II ended in the year", "1945"),
    ("The Declaration of Independence was signed in", "1776"),
    ("The first man to walk on the Moon was Neil", "Armstrong"),
    ("The Titanic sank after hitting an", "iceberg"),
    ("Napoleon was an emperor of", "France"),
    ("The ancient city of Rome was the capital of the Roman", "Empire"),
    ("Christopher Columbus sailed to the Americas in", "1492"),
    ("Romeo and Juliet was written by William", "Shakespeare"),
    ("The Mona Lisa was painted by Leonardo da", "Vinci"),
    ("The Berlin Wall fell in", "1989"),
    ("Martin Luther King Jr. gave his famous speech titled I Have a", "Dream"),
    ("The telephone was invented by Alexander Graham", "Bell"),
    ("The light bulb is often credited to Thomas", "Edison"),
    ("The theory of evolution by natural selection was proposed by Charles", "Darwin"),
    # Language
    ("The opposite of hot is", "cold"),
    ("The opposite of up is", "down"),
    ("The opposite of day is", "night"),
    ("The opposite of black is", "white"),
    ("The opposite of big is", "small"),
    ("The opposite of happy is", "sad"),
    ("The opposite of fast is", "slow"),
    ("The opposite of old is", "young"),
    ("The plural of mouse is", "mice"),
    ("The plural of child is", "children"),
    ("The past tense of go is", "went"),
    ("The past tense of eat is", "ate"),
    ("The French word for cat is", "chat"),
    ("The Spanish word for water is", "agua"),
    ("In German, the word for thank you is", "danke"),
    ("The first letter of the English alphabet is", "A"),
    ("The last letter of the English alphabet is", "Z"),
    ("A word that means the same as another word is called a", "synonym"),
    # Everyday knowledge / sequences
    ("Monday, Tuesday,", "Wednesday"),
    ("The day after Friday is", "Saturday"),
    ("The day before Sunday is", "Saturday"),
    ("January, February,", "March"),
    ("The month after June is", "July"),
    ("The last month of the year is", "December"),
    ("The first month of the year is", "January"),
    ("One, two, three, four,", "five"),
    ("There are seven days in a", "week"),
    ("There are twelve months in a", "year"),
    ("There are sixty minutes in an", "hour"),
    ("A year has four seasons: spring, summer, autumn and", "winter"),
    ("Grass is green and the sky is", "blue"),
    ("Snow is white and coal is", "black"),
    ("Ripe bananas are yellow and ripe tomatoes are", "red"),
    ("The color of a ripe lemon is", "yellow"),
    ("Mixing red and white paint gives the color", "pink"),
    ("Mixing blue and yellow paint gives the color", "green"),
    ("Two plus two equals", "four"),
    ("Five plus five equals", "ten"),
    ("A triangle has three", "sides"),
    ("A spider has eight", "legs"),
    ("A baby dog is called a", "puppy"),
    ("A baby cat is called a", "kitten"),
    ("A baby cow is called a", "calf"),
    ("The animal known as the king of the jungle is the", "lion"),
    ("The largest animal on Earth is the blue", "whale"),
    ("The fastest land animal is the", "cheetah"),
    ("Bees collect nectar from flowers to make", "honey"),
    ("The white drink that comes from cows is", "milk"),
    ("A group of wolves is called a", "pack"),
    ("The animal with a very long neck is the", "giraffe"),
    ("Penguins live mostly in the southern continent of", "Antarctica"),
    ("A frog begins its life as a", "tadpole"),
    ("A caterpillar turns into a", "butterfly"),
    ("People open an umbrella when it starts to", "rain"),
    ("Bread is baked in an", "oven"),
    ("You can tell the time by looking at a", "clock"),
    ("A person who treats sick animals is called a", "veterinarian"),
    ("A person who flies an airplane is called a", "pilot"),
    ("Chess is played on a board with sixty-four", "squares"),
    ("The Olympic Games are held every four", "years"),
    ("When water freezes it turns into", "ice"),
]


@dataclass
class ProbeResult:
    """Outcome of :func:`run_probe`."""

    correct: int
    total: int
    accuracy: float
    per_fact: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict."""
        return asdict(self)


def _normalise(text: str) -> str:
    """Lower-case and strip leading whitespace/punctuation."""
    return text.lstrip(_STRIP).lower()


def _answer_length(tokenizer: Any, prompt_ids: list[int], prompt: str, answer: str) -> int:
    """Number of tokens the answer occupies when appended to the prompt after a space."""
    full = tokenizer(prompt + " " + answer)["input_ids"]
    if full[: len(prompt_ids)] == prompt_ids:
        return max(1, len(full) - len(prompt_ids))
    return max(1, len(tokenizer(" " + answer, add_special_tokens=False)["input_ids"]))


def _forward_options(model: nn.Module) -> set[str]:
    """Optional forward arguments the model declares explicitly."""
    params = inspect.signature(model.forward).parameters
    return {name for name in ("position_ids", "use_cache") if name in params}


def _next_tokens(
    model: nn.Module, seqs: list[list[int]], pad_id: int, options: set[str], device: torch.device
) -> list[int]:
    """Greedy next token for each sequence, from one left-padded forward pass."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs: dict[str, Any] = {"attention_mask": mask}
    if "position_ids" in options:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    if "use_cache" in options:
        kwargs["use_cache"] = False
    logits = model(input_ids=ids, **kwargs).logits
    return logits[:, -1, :].argmax(-1).tolist()


@torch.no_grad()
def run_probe(
    model: nn.Module,
    tokenizer: Any,
    facts: Sequence[tuple[str, str]] = FACTS,
    batch_size: int = 16,
) -> ProbeResult:
    """Score greedy cloze completions of ``facts`` ((prompt, answer) pairs).

    A fact is correct when the greedy continuation, stripped of leading
    whitespace/punctuation, starts with the answer (case-insensitive). A row is
    decoded only while its text is still a strict prefix of the answer, for at
    most the answer's token count plus ``_SLACK`` tokens, so single-token answers
    cost one batched forward pass. Batches are left-padded by hand, so the
    tokenizer's padding side does not matter.
    """
    if not facts:
        raise ValueError("facts must not be empty")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    device = next(model.parameters()).device
    options = _forward_options(model)
    was_training = model.training
    model.eval()
    per_fact: list[dict[str, Any]] = []
    try:
        for start in range(0, len(facts), batch_size):
            batch = facts[start:start + batch_size]
            prompts = [tokenizer(p)["input_ids"] for p, _ in batch]
            targets = [_normalise(a) for _, a in batch]
            limits = [_answer_length(tokenizer, ids, p, a) + _SLACK for ids, (p, a) in zip(prompts, batch)]
            generated: list[list[int]] = [[] for _ in batch]
            pending = list(range(len(batch)))
            while pending:
                tokens = _next_tokens(model, [prompts[i] + generated[i] for i in pending], pad_id, options, device)
                still: list[int] = []
                for i, token in zip(pending, tokens):
                    generated[i].append(token)
                    text = _normalise(tokenizer.decode(generated[i], skip_special_tokens=True))
                    if len(text) < len(targets[i]) and targets[i].startswith(text) and len(generated[i]) < limits[i]:
                        still.append(i)
                pending = still
            for (prompt, answer), target, gen in zip(batch, targets, generated):
                prediction = tokenizer.decode(gen, skip_special_tokens=True).strip()
                per_fact.append({
                    "prompt": prompt,
                    "answer": answer,
                    "prediction": prediction,
                    "correct": _normalise(prediction).startswith(target),
                })
    finally:
        model.train(was_training)
    correct = sum(f["correct"] for f in per_fact)
    return ProbeResult(correct=correct, total=len(per_fact), accuracy=correct / len(per_fact), per_fact=per_fact)
