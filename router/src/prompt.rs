//! A request's prompt as routing needs it: token ids, their chained block
//! hashes and a key for tie-breaking, made without blocking the router's
//! async threads.
//!
//! Three costs, three treatments:
//! - hashing token ids is xxh3 at about a gigabyte a second: a prompt of up
//!   to [`INLINE_HASH_TOKENS`] is hashed inline (microseconds, less than a
//!   hop to another thread), a longer one on the blocking pool;
//! - tokenizing text costs 10–100x more: it runs on the blocking pool, at
//!   most `slots` at once (the router gives one per core), so a
//!   burst of long prompts queues instead of spawning a thread each;
//! - the same text comes back (a system prompt, a retried call, an agent's
//!   growing conversation is a new text each turn, but its earlier turns
//!   are not): a cache of recent texts' ids and hashes, bounded at
//!   [`TEXT_CACHE_TOKENS`] tokens, serves a repeat without tokenizing.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tandem_block_hash::BlockHash;
use tandem_proto::v1;
use tandem_proto::v1::generate_request::Prompt;
use tandem_tokenizer::Tokenizer;
use tokio::sync::Semaphore;
use tonic::Status;

/// Token-id prompts up to this long are hashed on the calling thread.
pub const INLINE_HASH_TOKENS: usize = 8192;

/// Tokens the text cache holds, over all entries (about 20 MB with their
/// hashes).
pub const TEXT_CACHE_TOKENS: usize = 1 << 22;

/// A prompt ready to route.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// What the workers are sent: token ids when they are known here.
    pub prompt: Prompt,
    /// How many token ids `prompt` holds (`None` for text without a
    /// tokenizer here).
    pub token_count: Option<usize>,
    pub hashes: Arc<Vec<BlockHash>>,
    /// The hash of the first (possibly partial) block: the same for
    /// prompts that share a first block.
    pub key: u64,
}

/// A text's hash, the hash root and the block size it was hashed with.
type TextKey = (u64, BlockHash, usize);

/// Token ids, block hashes and first-block key.
type Cached = (Vec<u32>, Arc<Vec<BlockHash>>, u64);

/// Recent texts' token ids and hashes, the oldest out first.
#[derive(Debug, Default)]
struct TextCache {
    entries: HashMap<TextKey, Cached>,
    /// Keys, oldest first.
    order: VecDeque<TextKey>,
    tokens: usize,
}

impl TextCache {
    fn get(&self, key: &TextKey) -> Option<Prepared> {
        let (ids, hashes, first) = self.entries.get(key)?;
        Some(prepared(ids.clone(), hashes.clone(), *first))
    }

    /// Keeps a copy of `p`'s ids and its hashes under `key`.
    fn put(&mut self, key: TextKey, p: &Prepared) {
        let Prompt::TokenIds(ids) = &p.prompt else {
            return;
        };
        let ids = &ids.ids;
        if ids.len() > TEXT_CACHE_TOKENS / 8 || self.entries.contains_key(&key) {
            return;
        }
        self.tokens += ids.len();
        self.entries
            .insert(key, (ids.clone(), p.hashes.clone(), p.key));
        self.order.push_back(key);
        while self.tokens > TEXT_CACHE_TOKENS {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some((ids, _, _)) = self.entries.remove(&old) {
                self.tokens -= ids.len();
            }
        }
    }
}

/// A prompt of token ids, which move into the request the workers get.
fn prepared(ids: Vec<u32>, hashes: Arc<Vec<BlockHash>>, key: u64) -> Prepared {
    Prepared {
        token_count: Some(ids.len()),
        prompt: Prompt::TokenIds(v1::TokenIds { ids }),
        hashes,
        key,
    }
}

/// Tokenizes and hashes prompts for one router.
#[derive(Debug)]
pub struct PromptPrep {
    tokenizer: Option<Arc<Tokenizer>>,
    slots: Arc<Semaphore>,
    cache: Mutex<TextCache>,
}

/// Hashes `ids` into a ready prompt.
fn hash_ids(ids: Vec<u32>, root: BlockHash, block_size: usize) -> Prepared {
    let hashes = tandem_block_hash::block_hashes_from(root, &ids, block_size);
    let key = tandem_block_hash::hash_block(root, &ids[..ids.len().min(block_size)]);
    prepared(ids, Arc::new(hashes), key)
}

impl PromptPrep {
    /// `slots` tokenizations at once (at least one).
    pub fn new(tokenizer: Option<Arc<Tokenizer>>, slots: usize) -> Self {
        Self {
            tokenizer,
            slots: Arc::new(Semaphore::new(slots.max(1))),
            cache: Mutex::default(),
        }
    }

    /// Token ids, hashes (from `root`, in blocks of `block_size`) and key
    /// of `prompt`.
    pub async fn prepare(
        &self,
        prompt: Prompt,
        root: BlockHash,
        block_size: usize,
    ) -> Result<Prepared, Status> {
        let block_size = block_size.max(1);
        let text = match prompt {
            Prompt::TokenIds(ids) if ids.ids.len() <= INLINE_HASH_TOKENS => {
                return Ok(hash_ids(ids.ids, root, block_size));
            }
            Prompt::TokenIds(ids) => {
                let ids = ids.ids;
                return self
                    .on_pool(move || Ok(hash_ids(ids, root, block_size)))
                    .await;
            }
            Prompt::Text(text) => text,
        };
        let Some(tokenizer) = self.tokenizer.clone().filter(|_| !text.is_empty()) else {
            // Routed by load alone; the worker tokenizes.
            let bytes: Vec<u32> = text.bytes().take(64).map(u32::from).collect();
            return Ok(Prepared {
                key: tandem_block_hash::hash_block(root, &bytes),
                prompt: Prompt::Text(text),
                token_count: None,
                hashes: Arc::default(),
            });
        };
        let cache_key = (text_key(&text), root, block_size);
        if let Some(hit) = self.lock_cache().get(&cache_key) {
            return Ok(hit);
        }
        let made = self
            .on_pool(move || {
                let ids = tokenizer
                    .encode(&text)
                    .map_err(|e| Status::invalid_argument(format!("prompt: {e}")))?;
                Ok(hash_ids(ids, root, block_size))
            })
            .await?;
        self.lock_cache().put(cache_key, &made);
        Ok(made)
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, TextCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `work` on the blocking pool once a slot is free.
    async fn on_pool(
        &self,
        work: impl FnOnce() -> Result<Prepared, Status> + Send + 'static,
    ) -> Result<Prepared, Status> {
        let _slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Status::unavailable("the router is shutting down"))?;
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| Status::internal(format!("preparing the prompt failed: {e}")))?
    }
}

/// The text's hash: the cache key (a 64-bit collision is not a concern
/// at this cache's size).
fn text_key(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Prompt {
        Prompt::TokenIds(v1::TokenIds {
            ids: (0..n).collect(),
        })
    }

    #[tokio::test]
    async fn short_and_long_token_prompts_hash_alike() {
        let prep = PromptPrep::new(None, 1);
        for n in [5, 40, INLINE_HASH_TOKENS as u32 + 40] {
            let p = prep.prepare(ids(n), 0, 16).await.expect("prepared");
            let want: Vec<u32> = (0..n).collect();
            assert_eq!(
                *p.hashes,
                tandem_block_hash::block_hashes(&want, 16),
                "{n} tokens"
            );
            assert_eq!(
                p.key,
                tandem_block_hash::hash_block(0, &want[..want.len().min(16)])
            );
        }
    }

    #[test]
    fn the_text_cache_keeps_its_token_budget() {
        let mut cache = TextCache::default();
        let big = vec![1u32; TEXT_CACHE_TOKENS / 8];
        for i in 0..20u64 {
            let p = prepared(big.clone(), Arc::default(), i);
            cache.put((i, 0, 16), &p);
            assert!(cache.tokens <= TEXT_CACHE_TOKENS);
        }
        assert!(cache.get(&(19, 0, 16)).is_some(), "the newest stays");
        assert!(cache.get(&(0, 0, 16)).is_none(), "the oldest went");
        assert_eq!(cache.entries.len(), cache.order.len());
    }
}
