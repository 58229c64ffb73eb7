//! A checkpoint directory opened as a whole: model, tokenizer, generation
//! defaults.

use std::path::{Path, PathBuf};

use crate::config::{read_json, token_ids};
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// Everything the engine takes from a Hugging Face checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub model: Model,
    /// `None` when the directory has no `tokenizer.json`: token ids still work.
    pub tokenizer: Option<Tokenizer>,
    /// End-of-sequence ids: `generation_config.json` first, else `config.json`.
    pub eos_token_ids: Vec<u32>,
}

impl Checkpoint {
    /// Opens a checkpoint directory.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(EngineError::MissingFile {
                path: dir.to_path_buf(),
                what: "the model directory does not exist",
            });
        }
        let model = Model::load(dir)?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.is_file() {
            Some(Tokenizer::from_file(&tok_path)?)
        } else {
            None
        };
        let gen_path = dir.join("generation_config.json");
        let mut eos_token_ids = Vec::new();
        if gen_path.is_file() {
            let v = read_json(&gen_path)?;
            eos_token_ids = token_ids(v.get("eos_token_id"));
        }
        if eos_token_ids.is_empty() {
            eos_token_ids = model.config().eos_token_ids.clone();
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            model,
            tokenizer,
            eos_token_ids,
        })
    }

    /// The tokenizer, or an error saying it is absent.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            EngineError::Tokenizer(format!(
                "{} has no tokenizer.json; pass token ids instead of text",
                self.dir.display()
            ))
        })
    }
}
