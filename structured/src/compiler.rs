//! Compiling formats into grammars, with a bounded cache.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use llguidance::{Matcher, ParserFactory};

use crate::constraint::{Constraint, TokenMask};
use crate::error::{Result, StructuredError};
use crate::format::ResponseFormat;
use crate::vocab::Vocabulary;

/// Compiled grammars kept per compiler, least recently used evicted first.
pub const DEFAULT_CACHE_CAPACITY: usize = 64;

/// A format compiled for one vocabulary: a parser at the start of the output
/// and the mask of the first token.
pub struct CompiledGrammar {
    format: ResponseFormat,
    /// Never advanced; each sequence starts from a deep copy. Behind a lock
    /// because a parser shares its lexer cache with shallow copies.
    start: Mutex<Matcher>,
    first_mask: TokenMask,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("format", &self.format.kind())
            .field("first_mask_allows", &self.first_mask.num_allowed())
            .finish_non_exhaustive()
    }
}

impl CompiledGrammar {
    /// What was compiled.
    pub fn format(&self) -> &ResponseFormat {
        &self.format
    }

    /// A sequence's state at the start of its output.
    pub fn start(self: &Arc<Self>) -> Constraint {
        let matcher = self
            .start
            .lock()
            .map_or_else(|e| e.into_inner().deep_clone(), |m| m.deep_clone());
        Constraint::new(matcher, self.first_mask.clone())
    }
}

/// Cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: usize,
}

/// (tokenizer fingerprint, format): a grammar compiled for one vocabulary
/// is useless for another.
type Key = (u64, ResponseFormat);

#[derive(Debug, Default)]
struct Cache {
    entries: HashMap<Key, (Arc<CompiledGrammar>, u64)>,
    clock: u64,
}

/// Compiles formats for one vocabulary. Cheap to share (`Arc`); `compile`
/// may be called from any thread.
pub struct GrammarCompiler {
    factory: ParserFactory,
    fingerprint: u64,
    capacity: usize,
    cache: Mutex<Cache>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("fingerprint", &self.fingerprint)
            .field("capacity", &self.capacity)
            .field("stats", &self.cache_stats())
            .finish_non_exhaustive()
    }
}

fn anyhow_msg(e: &dyn std::fmt::Display) -> String {
    e.to_string()
}

impl GrammarCompiler {
    /// A compiler for `vocab` caching up to `capacity` grammars.
    pub fn new(vocab: &Vocabulary, capacity: usize) -> Result<Self> {
        let env = vocab.tok_env();
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| StructuredError::Tokenizer(anyhow_msg(&e)))?;
        // Errors come back as values; nothing goes to stderr.
        factory.quiet();
        Ok(Self {
            factory,
            fingerprint: vocab.fingerprint(),
            capacity: capacity.max(1),
            cache: Mutex::new(Cache::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    /// The vocabulary's fingerprint (part of every cache key).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Compiles `format`, or returns the cached grammar. An invalid format
    /// is [`StructuredError::InvalidFormat`] with the grammar engine's
    /// message.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Arc<CompiledGrammar>> {
        let key = (self.fingerprint, format.clone());
        if let Some(g) = self.lookup(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(g);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        // Compiled outside the lock: a slow schema must not stall others.
        let grammar = Arc::new(self.compile_uncached(format)?);
        self.insert(key, grammar.clone());
        Ok(grammar)
    }

    fn compile_uncached(&self, format: &ResponseFormat) -> Result<CompiledGrammar> {
        let invalid = |message: String| StructuredError::InvalidFormat {
            kind: format.kind(),
            message,
        };
        let top = format.to_grammar()?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| invalid(anyhow_msg(&e)))?;
        let mut start = Matcher::new(Ok(parser));
        // Grammars can fail late (on the first mask): check now, at
        // admission, and keep the mask for every sequence's first token.
        let first = start.compute_mask().map_err(|e| invalid(anyhow_msg(&e)))?;
        let first_mask = TokenMask::from_vob(first);
        if first_mask.num_allowed() == 0 {
            return Err(invalid(
                "no token of the vocabulary can start the output".into(),
            ));
        }
        Ok(CompiledGrammar {
            format: format.clone(),
            start: Mutex::new(start),
            first_mask,
        })
    }

    fn lookup(&self, key: &Key) -> Option<Arc<CompiledGrammar>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.clock += 1;
        let now = cache.clock;
        cache.entries.get_mut(key).map(|(g, used)| {
            *used = now;
            g.clone()
        })
    }

    fn insert(&self, key: Key, grammar: Arc<CompiledGrammar>) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.clock += 1;
        let now = cache.clock;
        if !cache.entries.contains_key(&key) && cache.entries.len() >= self.capacity {
            let oldest = cache
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                cache.entries.remove(&k);
            }
        }
        cache.entries.insert(key, (grammar, now));
    }

    /// Hits, misses and entries of the grammar cache.
    pub fn cache_stats(&self) -> CacheStats {
        let entries = self
            .cache
            .lock()
            .map_or_else(|e| e.into_inner().entries.len(), |c| c.entries.len());
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries,
        }
    }
}
