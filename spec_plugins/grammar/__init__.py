"""Structured outputs: grammar constraints applied exactly at every drafted node (``rounds``)."""

from spec_plugins.grammar.matcher import RowGrammar, ll_tokenizer
from spec_plugins.grammar.spec import Compiled, GrammarError, GrammarLimits, GrammarSpec, compile_grammar

__all__ = ["Compiled", "GrammarError", "GrammarLimits", "GrammarSpec", "RowGrammar", "compile_grammar", "ll_tokenizer"]
