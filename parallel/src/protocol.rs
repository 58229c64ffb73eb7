//! What the leader tells its followers, in a small little-endian binary
//! form (commands are tiny next to the activations that follow them).

use tandem_engine::kernels::MatmulPolicy;
use tandem_engine::SeqInput;

use crate::ParallelError;

/// One sequence of a step, owned (it crosses a process boundary).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnedSeq {
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    pub blocks: Vec<u32>,
    pub all_logits: bool,
}

impl OwnedSeq {
    pub fn of(s: &SeqInput<'_>) -> Self {
        Self {
            tokens: s.tokens.to_vec(),
            start_pos: s.start_pos,
            blocks: s.blocks.to_vec(),
            all_logits: s.all_logits,
        }
    }

    pub fn input(&self) -> SeqInput<'_> {
        SeqInput {
            tokens: &self.tokens,
            start_pos: self.start_pos,
            blocks: &self.blocks,
            all_logits: self.all_logits,
            lora: None,
        }
    }
}

/// A leader's command to every follower (or, for `Write`/`Read`, to the
/// ranks holding that layer).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Command {
    /// The pool to build and the model the leader runs.
    Setup {
        block_size: usize,
        num_blocks: usize,
        kv_dtype: String,
        fingerprint: String,
    },
    /// Run these micro-batches, in order.
    Step {
        micro_batches: Vec<Vec<OwnedSeq>>,
    },
    Copy {
        src: u32,
        dst: u32,
    },
    /// This rank's heads of one layer of one block.
    Write {
        layer: usize,
        block: u32,
        k: Vec<f32>,
        v: Vec<f32>,
    },
    /// Reply with this rank's heads of one layer of one block (K then V).
    Read {
        layer: usize,
        block: u32,
    },
    /// Run the linears under this policy from now on.
    MatmulPolicy(MatmulPolicy),
    Shutdown,
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u64(&mut self, x: usize) {
        self.0.extend_from_slice(&(x as u64).to_le_bytes());
    }
    fn u32s(&mut self, xs: &[u32]) {
        self.u64(xs.len());
        for x in xs {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    fn f32s(&mut self, xs: &[f32]) {
        self.u64(xs.len());
        for x in xs {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ParallelError> {
        if self.0.len() < n {
            return Err(ParallelError::Protocol(format!(
                "command truncated: wanted {n} more bytes, {} left",
                self.0.len()
            )));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, ParallelError> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<usize, ParallelError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        usize::try_from(u64::from_le_bytes(b))
            .map_err(|_| ParallelError::Protocol("a length does not fit in memory".into()))
    }
    fn len(&mut self, elem: usize) -> Result<usize, ParallelError> {
        let n = self.u64()?;
        if n.saturating_mul(elem) > self.0.len() {
            return Err(ParallelError::Protocol(format!(
                "a list of {n} elements is longer than its command"
            )));
        }
        Ok(n)
    }
    fn u32(&mut self) -> Result<u32, ParallelError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u32s(&mut self) -> Result<Vec<u32>, ParallelError> {
        let n = self.len(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn f32s(&mut self) -> Result<Vec<f32>, ParallelError> {
        let n = self.len(4)?;
        Ok(self
            .take(n * 4)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn str(&mut self) -> Result<String, ParallelError> {
        let n = self.len(1)?;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| ParallelError::Protocol("a string is not UTF-8".into()))
    }
}

impl Command {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Self::Setup {
                block_size,
                num_blocks,
                kv_dtype,
                fingerprint,
            } => {
                w.u8(1);
                w.u64(*block_size);
                w.u64(*num_blocks);
                w.str(kv_dtype);
                w.str(fingerprint);
            }
            Self::Step { micro_batches } => {
                w.u8(2);
                w.u64(micro_batches.len());
                for mb in micro_batches {
                    w.u64(mb.len());
                    for s in mb {
                        w.u32s(&s.tokens);
                        w.u64(s.start_pos);
                        w.u32s(&s.blocks);
                        w.u8(u8::from(s.all_logits));
                    }
                }
            }
            Self::Copy { src, dst } => {
                w.u8(3);
                w.u32s(&[*src, *dst]);
            }
            Self::Write { layer, block, k, v } => {
                w.u8(4);
                w.u64(*layer);
                w.u32s(&[*block]);
                w.f32s(k);
                w.f32s(v);
            }
            Self::Read { layer, block } => {
                w.u8(5);
                w.u64(*layer);
                w.u32s(&[*block]);
            }
            Self::MatmulPolicy(policy) => {
                w.u8(6);
                w.u8(policy.code());
            }
            Self::Shutdown => w.u8(7),
        }
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ParallelError> {
        let mut r = Reader(bytes);
        let one = |r: &mut Reader<'_>| -> Result<u32, ParallelError> {
            match r.u32s()?.as_slice() {
                [x] => Ok(*x),
                other => Err(ParallelError::Protocol(format!(
                    "expected one block id, got {}",
                    other.len()
                ))),
            }
        };
        let cmd = match r.u8()? {
            1 => Self::Setup {
                block_size: r.u64()?,
                num_blocks: r.u64()?,
                kv_dtype: r.str()?,
                fingerprint: r.str()?,
            },
            2 => {
                let n = r.len(8)?;
                let mut micro_batches = Vec::with_capacity(n);
                for _ in 0..n {
                    let m = r.len(8)?;
                    let mut mb = Vec::with_capacity(m);
                    for _ in 0..m {
                        mb.push(OwnedSeq {
                            tokens: r.u32s()?,
                            start_pos: r.u64()?,
                            blocks: r.u32s()?,
                            all_logits: r.u8()? != 0,
                        });
                    }
                    micro_batches.push(mb);
                }
                Self::Step { micro_batches }
            }
            3 => match r.u32s()?.as_slice() {
                [src, dst] => Self::Copy {
                    src: *src,
                    dst: *dst,
                },
                _ => {
                    return Err(ParallelError::Protocol(
                        "a block copy names two blocks".into(),
                    ))
                }
            },
            4 => Self::Write {
                layer: r.u64()?,
                block: one(&mut r)?,
                k: r.f32s()?,
                v: r.f32s()?,
            },
            5 => Self::Read {
                layer: r.u64()?,
                block: one(&mut r)?,
            },
            6 => {
                let code = r.u8()?;
                Self::MatmulPolicy(MatmulPolicy::from_code(code).ok_or_else(|| {
                    ParallelError::Protocol(format!("unknown matmul policy {code}"))
                })?)
            }
            7 => Self::Shutdown,
            tag => return Err(ParallelError::Protocol(format!("unknown command {tag}"))),
        };
        if !r.0.is_empty() {
            return Err(ParallelError::Protocol(format!(
                "{} stray bytes after a command",
                r.0.len()
            )));
        }
        Ok(cmd)
    }
}

/// A follower's answer to `Setup`: ready, or why not (its error's message:
/// the leader only reports it, in `ParallelError::Setup`).
pub(crate) fn encode_ready(result: &Result<(), String>) -> Vec<u8> {
    let mut w = Writer::default();
    match result {
        Ok(()) => w.u8(0),
        Err(e) => {
            w.u8(1);
            w.str(e);
        }
    }
    w.0
}

pub(crate) fn decode_ready(bytes: &[u8]) -> Result<Result<(), String>, ParallelError> {
    let mut r = Reader(bytes);
    match r.u8()? {
        0 => Ok(Ok(())),
        1 => Ok(Err(r.str()?)),
        tag => Err(ParallelError::Protocol(format!(
            "unknown setup reply {tag}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_round_trip_and_garbage_is_refused() {
        let cmds = [
            Command::Setup {
                block_size: 16,
                num_blocks: 100,
                kv_dtype: "int8".into(),
                fingerprint: "llama".into(),
            },
            Command::Step {
                micro_batches: vec![
                    vec![OwnedSeq {
                        tokens: vec![1, 2, 3],
                        start_pos: 5,
                        blocks: vec![7, 8],
                        all_logits: true,
                    }],
                    vec![],
                ],
            },
            Command::Copy { src: 1, dst: 2 },
            Command::Write {
                layer: 3,
                block: 4,
                k: vec![1.5, -2.0],
                v: vec![0.25],
            },
            Command::Read { layer: 1, block: 9 },
            Command::MatmulPolicy(MatmulPolicy::BatchInvariant),
            Command::MatmulPolicy(MatmulPolicy::Bf16Activations),
            Command::Shutdown,
        ];
        for c in cmds {
            let bytes = c.encode();
            assert_eq!(Command::decode(&bytes).expect("round trip"), c);
            if bytes.len() > 1 {
                assert!(Command::decode(&bytes[..bytes.len() - 1]).is_err());
            }
        }
        assert!(Command::decode(&[]).is_err());
        assert!(Command::decode(&[99]).is_err());
        // A list that claims more elements than the frame holds.
        let mut huge = vec![2u8];
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(Command::decode(&huge).is_err());
        assert_eq!(
            decode_ready(&encode_ready(&Err("no".into()))).expect("reply"),
            Err("no".to_string())
        );
    }
}
