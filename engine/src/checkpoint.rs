//! A checkpoint directory opened as a whole: model, tokenizer, generation
//! defaults.

use std::path::{Path, PathBuf};

use crate::config::{read_json, token_ids};
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::Residency;

/// The tokenizer of a checkpoint: a directory's `tokenizer.json`, or the
/// vocabulary a GGUF file carries; `None` when there is neither.
pub fn tokenizer_of(path: &Path) -> Result<Option<Tokenizer>> {
    if crate::gguf::is_gguf(path) {
        return crate::gguf::tokenizer(&crate::gguf::open(path)?);
    }
    let file = path.join("tokenizer.json");
    match file.is_file() {
        true => Ok(Some(Tokenizer::from_file(&file)?)),
        false => Ok(None),
    }
}

/// The model's name (what membership checks and the HTTP API's `model`
/// use): a directory's name, or a GGUF file's name without `.gguf` and a
/// split's `-00001-of-0000N`.
pub fn model_name(path: &Path) -> String {
    if crate::gguf::is_gguf(path) {
        return crate::gguf::model_name(path);
    }
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

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
    ///
    /// A path to a `.gguf` file opens that file: model, tokenizer and end
    /// tokens all come from it.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_with(dir, Residency::HugePages)
    }

    /// [`Self::open`] with the model's weights held as `residency` asks
    /// ([`Model::load_with`]; a GGUF file is always mapped).
    pub fn open_with(dir: &Path, residency: Residency) -> Result<Self> {
        if crate::gguf::is_gguf(dir) {
            return Self::open_gguf(dir);
        }
        if !dir.is_dir() {
            return Err(EngineError::MissingFile {
                path: dir.to_path_buf(),
                what: "the model directory does not exist",
            });
        }
        let model = Model::load_with(dir, residency)?;
        let tokenizer = tokenizer_of(dir)?;
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

    fn open_gguf(path: &Path) -> Result<Self> {
        let model = Model::load_with(path, Residency::Mapped)?;
        let tokenizer = tokenizer_of(path)?;
        let eos_token_ids = model.config().eos_token_ids.clone();
        Ok(Self {
            dir: path.to_path_buf(),
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
