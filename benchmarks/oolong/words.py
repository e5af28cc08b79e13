"""Instance templates and word lists for the generated tasks, per dataset and label.

``trec_coarse``: general-knowledge questions, one template set per TREC-coarse label. Every label
has templates that open with the same few words ("What", "Which", "How", "Name", "In"), so the
first word of an instance does not give its label away: the label follows from what is asked
(an expansion, a thing, an explanation, a person, a place, a number).

``app_reviews``: short reviews of apps, ``positive`` or ``negative``; both open the same ways.

`DATASETS` holds each dataset's label set, templates and the sentence OOLONG-synth's context
header uses to describe its lines.
"""

from __future__ import annotations

from dataclasses import dataclass

LABELS = (
    "abbreviation",
    "entity",
    "description and abstract concept",
    "human being",
    "location",
    "numeric value",
)

TEMPLATES: dict[str, tuple[str, ...]] = {
    "abbreviation": (
        "What does {abbr} stand for ?",
        "What is the full form of {abbr} ?",
        "Which words make up the acronym {abbr} ?",
        "How is the abbreviation {abbr} written out in full ?",
        "In {field} , what is {abbr} short for ?",
        "Name the words behind the letters {abbr} .",
        "What do the initials {abbr} mean on a {thing} label ?",
    ),
    "entity": (
        "What {animal} is most often seen near {place} ?",
        "Which {instrument} is heard in traditional {genre} music ?",
        "What is the name of the {thing} used in {sport} ?",
        "How do you call the {thing} that holds a {fruit} ?",
        "Name a {fruit} that grows well in {place} .",
        "In {field} , which {thing} is used most ?",
        "What breed of {animal} did the {profession} keep ?",
    ),
    "description and abstract concept": (
        "What is the meaning of {concept} ?",
        "How come {phenomenon} happens in {place} ?",
        "How does a {machine} work ?",
        "What is the difference between {concept} and {concept2} ?",
        "Which ideas led to the study of {concept} ?",
        "In {field} , how is {concept} defined ?",
        "Name the main causes of {phenomenon} .",
    ),
    "human being": (
        "Which person invented the {machine} ?",
        "Which {profession} first described {concept} ?",
        "What was the name of the first {role} of {place} ?",
        "How was the {profession} who studied {phenomenon} called ?",
        "Name the {role} who founded the {field} society .",
        "In {year} , which {profession} won the {field} prize ?",
        "What {profession} painted the famous {thing} of {place} ?",
    ),
    "location": (
        "What town is home to the {landmark} of {place} ?",
        "What city hosted the {year} {sport} games ?",
        "Which country lies north of {place} ?",
        "How is the river that flows through {place} named ?",
        "Name the region where the {fruit} was first grown .",
        "In which valley is the {landmark} found ?",
        "What is the capital of the {field} district of {place} ?",
    ),
    "numeric value": (
        "How many {unit} are there in a {bigunit} ?",
        "What year was the {landmark} of {place} built ?",
        "How far is {place} from {place2} ?",
        "What is the population of {place} ?",
        "Which year saw the first {machine} sold ?",
        "In {field} , how many {unit} make one {bigunit} ?",
        "Name the temperature at which {phenomenon} starts .",
    ),
}

WORDS: dict[str, tuple[str, ...]] = {
    "animal": ("heron", "badger", "otter", "lynx", "ibis", "gecko", "bison", "marten", "puffin",
               "tapir", "walrus", "kestrel", "newt", "yak", "dingo", "lemur"),
    "instrument": ("lute", "oboe", "zither", "tabla", "fiddle", "harp", "sitar", "bagpipe",
                   "marimba", "cornet", "dulcimer", "ocarina"),
    "genre": ("Celtic", "Andean", "Balkan", "Nordic", "Persian", "Malian", "Cuban", "Tuvan"),
    "thing": ("basket", "lantern", "spindle", "compass", "ledger", "kettle", "anvil", "tripod",
              "bellows", "sextant", "quill", "loom", "trellis", "satchel"),
    "fruit": ("quince", "papaya", "lychee", "fig", "persimmon", "guava", "medlar", "plum",
              "kumquat", "durian", "apricot", "mulberry"),
    "sport": ("curling", "fencing", "rowing", "polo", "archery", "lacrosse", "bobsleigh",
              "hurling", "kabaddi", "squash"),
    "field": ("chemistry", "shipping", "banking", "medicine", "geology", "aviation", "law",
              "astronomy", "farming", "printing", "weaving", "surveying"),
    "concept": ("entropy", "irony", "inflation", "symbiosis", "parallax", "utilitarianism",
                "osmosis", "hyperbole", "democracy", "recursion", "stoicism", "erosion"),
    "concept2": ("enthalpy", "sarcasm", "deflation", "parasitism", "aberration", "altruism",
                 "diffusion", "litotes", "oligarchy", "iteration", "cynicism", "weathering"),
    "phenomenon": ("fog", "rust", "an eclipse", "a tide", "hail", "an aurora", "a drought",
                   "static shock", "frost heave", "a rainbow", "a monsoon", "a mirage"),
    "machine": ("telegraph", "sewing machine", "barometer", "steam engine", "typewriter",
                "periscope", "phonograph", "seismograph", "loom", "dynamo", "bicycle", "elevator"),
    "profession": ("chemist", "painter", "surveyor", "physician", "sculptor", "astronomer",
                   "botanist", "engineer", "poet", "cartographer", "architect", "composer"),
    "role": ("mayor", "governor", "chancellor", "bishop", "admiral", "president", "abbot",
             "consul", "magistrate", "rector"),
    "place": ("Valdoria", "Kestrel Bay", "Marrowick", "Lunesse", "Tarvik", "Ossoria", "Brennmoor",
              "Caldera Point", "Ysolde", "Fenwick Downs", "Porto Amaro", "Halvard", "Sunmere",
              "Dravik", "Quellen", "Arrowgate"),
    "place2": ("Norrland", "Eastmarch", "Vellmar", "Corvino", "Saltgrave", "Pellham", "Ardenne",
               "Tolmira"),
    "landmark": ("old lighthouse", "stone bridge", "grand library", "clock tower", "royal mint",
                 "salt mine", "observatory", "harbour wall", "cathedral", "opera house"),
    "unit": ("ounces", "inches", "minutes", "pints", "yards", "grams", "furlongs", "seconds"),
    "bigunit": ("pound", "foot", "day", "gallon", "mile", "kilogram", "league", "fortnight"),
}

ABBR_LETTERS = "ABCDEFGHIJKLMNOPRSTUVW"

REVIEW_LABELS = ("negative", "positive")

REVIEW_TEMPLATES: dict[str, tuple[str, ...]] = {
    "positive": (
        "The {app} app makes {task} so easy , I use it every day .",
        "After the update the {feature} works perfectly and loads fast .",
        "Great app for {task} , the {feature} is exactly what I needed .",
        "I was sceptical but the {app} app saved me hours of {task} .",
        "Love the clean design and the {feature} , five stars .",
        "Works offline , never crashes , and {task} takes seconds now .",
    ),
    "negative": (
        "The {app} app crashes every time I try {task} .",
        "After the update the {feature} stopped working and nobody answers .",
        "Terrible app for {task} , the {feature} is full of ads .",
        "I was hopeful but the {app} app lost all my data during {task} .",
        "Hate the cluttered design and the {feature} , one star .",
        "Drains the battery , freezes often , and {task} takes forever now .",
    ),
}

WORDS["app"] = ("Ledgerly", "TrailMate", "Pocketbook", "Noteforge", "Brightcal", "Parcelo",
                "Sleepwise", "Cookbox", "Stepcount", "Photobin", "Busline", "Quizzle")
WORDS["task"] = ("budgeting", "planning trips", "taking notes", "tracking sleep", "cooking",
                 "sharing photos", "paying bills", "learning words", "booking rides",
                 "counting steps")
WORDS["feature"] = ("search bar", "dark mode", "calendar sync", "photo editor", "widget",
                    "export button", "reminder", "login screen", "offline mode", "chat")


@dataclass(frozen=True)
class Dataset:
    """What the generator needs to write one kind of context window."""

    labels: tuple[str, ...]
    templates: dict[str, tuple[str, ...]]
    lines: str
    """What the context header says its lines are (OOLONG-synth's wording for the dataset);
    ``{k}`` and ``{labels}`` are filled in."""


DATASETS: dict[str, Dataset] = {
    "trec_coarse": Dataset(
        LABELS, TEMPLATES,
        "general-knowledge questions, one per line. Each question has an answer that can be "
        "described as one of {k} categories: {labels}."),
    "app_reviews": Dataset(
        REVIEW_LABELS, REVIEW_TEMPLATES,
        "reviews of software applications, one per line. Each review can be classified as "
        "positive or negative; there are no neutral reviews."),
}
