"""Real data for the models: UD English EWT dependency trees (CoNLL-U).

The dev split of UD English EWT v2.16 ships inside the package (CC BY-SA 4.0;
``ud_english_ewt/LICENSE.txt`` and ``README.md`` keep the attribution).
"""

from batchcraft.data.bracketed import BracketedTree, read_bracketed
from batchcraft.data.conllu_trees import Sentence, default_path, load_sentences, read_conllu
from batchcraft.data.vocab import UPOS_TAGS, Vocab, encode

__all__ = ["BracketedTree", "read_bracketed", "Sentence", "load_sentences", "read_conllu", "default_path", "Vocab", "UPOS_TAGS", "encode"]
