//! The connection handshake both transports run over TCP (UCX's control
//! channel is TCP too): magic, version, layout and the cluster token.
//!
//! Peers are authenticated by the cluster token without sending it: each
//! side proves it holds the token with an HMAC over both sides' fresh nonces
//! (see the `protocol` module's source), so a peer without the token cannot
//! write a block, a listener without it never receives one, the token never
//! crosses the wire, and a recorded handshake cannot be replayed. The frames
//! after the handshake are not encrypted (KV blocks are activations, not
//! secrets; the gRPC hops carrying prompts and tokens are mTLS).

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::protocol;
use crate::tcp::TcpConfig;
use crate::{KvLayoutDescriptor, TransferError};

/// Reads exactly `buf` during the sender's handshake; a peer that hangs up
/// is named as probably not a listener of this transport.
async fn read_reply_part<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
    magic: [u8; 8],
    endpoint: &str,
) -> Result<(), TransferError> {
    reader.read_exact(buf).await.map(|_| ()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            TransferError::ConnectionLost(format!(
                "{endpoint} closed the connection during the handshake (not a tandem KV \
                 transfer listener, or one with another --kv-transport than {}?)",
                protocol::transport_name(magic)
            ))
        } else {
            TransferError::io("reading the handshake reply", &e)
        }
    })
}

/// The sender's half of the handshake (`magic` names the transport):
/// hello, the receiver's challenge, our proof, the reply with the
/// receiver's proof. Returns the receiver's pool size.
pub(crate) async fn client_handshake(
    magic: [u8; 8],
    reader: &mut OwnedReadHalf,
    writer: &mut OwnedWriteHalf,
    layout: &KvLayoutDescriptor,
    config: &TcpConfig,
    endpoint: &str,
) -> Result<u32, TransferError> {
    let key = protocol::secret_key(config.cluster_token.as_bytes());
    let sender_nonce = protocol::nonce()?;
    let hello = protocol::encode_hello(magic, layout, &sender_nonce);
    writer
        .write_all(&hello)
        .await
        .map_err(|e| TransferError::io("sending the handshake", &e))?;
    let mut reply_bytes = [0u8; protocol::REPLY_LEN];
    let mut greeting = [0u8; protocol::GREETING_LEN];
    read_reply_part(reader, &mut greeting, magic, endpoint).await?;
    let version = protocol::decode_greeting(magic, &greeting)?;
    if version != protocol::VERSION {
        // A listener of another version answers the hello with a refusal.
        return Err(TransferError::VersionMismatch {
            here: protocol::VERSION,
            peer: version,
        });
    }
    let mut receiver_nonce = [0u8; protocol::NONCE_LEN];
    read_reply_part(reader, &mut receiver_nonce, magic, endpoint).await?;
    let proof = protocol::sender_proof(
        &key,
        magic,
        &sender_nonce,
        &receiver_nonce,
        &layout.encode(),
    );
    writer
        .write_all(&proof)
        .await
        .map_err(|e| TransferError::io("sending the handshake proof", &e))?;
    read_reply_part(reader, &mut reply_bytes, magic, endpoint).await?;
    let reply = protocol::decode_reply(magic, &reply_bytes)?;
    if reply.version != protocol::VERSION {
        return Err(TransferError::VersionMismatch {
            here: protocol::VERSION,
            peer: reply.version,
        });
    }
    let peer_layout = reply.layout?;
    match reply.status {
        protocol::STATUS_OK => {
            // The receiver must prove the secret too before it sees a block.
            let receiver = protocol::ReceiverProof {
                key: &key,
                sender_nonce: &sender_nonce,
                receiver_nonce: &receiver_nonce,
            };
            if !protocol::verify_receiver(magic, &reply_bytes, receiver) {
                return Err(TransferError::BadToken);
            }
        }
        protocol::STATUS_TOKEN => return Err(TransferError::BadToken),
        protocol::STATUS_LAYOUT_MISMATCH => {
            layout.check_compatible(&peer_layout)?;
            return Err(TransferError::Protocol(
                "the peer refused our layout although it matches its own".into(),
            ));
        }
        protocol::STATUS_LAYOUT_INVALID => {
            return Err(TransferError::InvalidLayout(format!(
                "the peer cannot use our layout ({layout})"
            )))
        }
        protocol::STATUS_VERSION => {
            return Err(TransferError::Protocol(
                "the peer refused our protocol version".into(),
            ))
        }
        other => {
            return Err(TransferError::Protocol(format!(
                "unknown handshake status {other}"
            )))
        }
    }
    layout.check_compatible(&peer_layout)?;
    Ok(reply.num_blocks)
}

/// The receiver's half of the handshake (`magic` names the transport):
/// the sender's hello, our challenge, the sender's proof, our reply (with
/// our proof when accepted). Nothing the sender writes is read as a frame
/// before its proof checked out.
pub(crate) async fn server_handshake<R: AsyncRead + Unpin>(
    magic: [u8; 8],
    reader: &mut R,
    writer: &mut OwnedWriteHalf,
    layout: &KvLayoutDescriptor,
    config: &TcpConfig,
    num_blocks: u32,
) -> Result<(), TransferError> {
    let mut hello = [0u8; protocol::HELLO_LEN];
    reader
        .read_exact(&mut hello[..protocol::GREETING_LEN])
        .await
        .map_err(|e| TransferError::io("reading the sender's hello", &e))?;
    protocol::check_sender_magic(magic, &hello)?;
    let version = u16::from_le_bytes([hello[8], hello[9]]);
    if version != protocol::VERSION {
        // Refuse at once: an older sender's hello is shorter than ours.
        let reply =
            protocol::encode_reply(magic, protocol::STATUS_VERSION, layout, num_blocks, None);
        let _ = writer.write_all(&reply).await;
        return Err(TransferError::VersionMismatch {
            here: protocol::VERSION,
            peer: version,
        });
    }
    reader
        .read_exact(&mut hello[protocol::GREETING_LEN..])
        .await
        .map_err(|e| TransferError::io("reading the sender's hello", &e))?;
    let hello = protocol::decode_hello(magic, &hello)?;
    let receiver_nonce = protocol::nonce()?;
    writer
        .write_all(&protocol::encode_challenge(magic, &receiver_nonce))
        .await
        .map_err(|e| TransferError::io("sending the handshake challenge", &e))?;
    let mut proof = [0u8; protocol::PROOF_LEN];
    reader
        .read_exact(&mut proof)
        .await
        .map_err(|e| TransferError::io("reading the sender's proof", &e))?;
    let key = protocol::secret_key(config.cluster_token.as_bytes());
    let proven = protocol::verify_sender(
        &key,
        magic,
        &hello.nonce,
        &receiver_nonce,
        &hello.layout_bytes,
        &proof,
    );
    let verdict = if !proven {
        Err((protocol::STATUS_TOKEN, TransferError::BadToken))
    } else {
        match hello.layout {
            Err(e) => Err((protocol::STATUS_LAYOUT_INVALID, e)),
            Ok(theirs) => match theirs.validate().and(layout.check_compatible(&theirs)) {
                Ok(()) => Ok(()),
                Err(e @ TransferError::LayoutMismatch { .. }) => {
                    Err((protocol::STATUS_LAYOUT_MISMATCH, e))
                }
                Err(e) => Err((protocol::STATUS_LAYOUT_INVALID, e)),
            },
        }
    };
    let (status, receiver_proof) = match &verdict {
        Ok(()) => (
            protocol::STATUS_OK,
            Some(protocol::ReceiverProof {
                key: &key,
                sender_nonce: &hello.nonce,
                receiver_nonce: &receiver_nonce,
            }),
        ),
        Err((status, _)) => (*status, None),
    };
    let reply = protocol::encode_reply(magic, status, layout, num_blocks, receiver_proof);
    let sent = writer
        .write_all(&reply)
        .await
        .map_err(|e| TransferError::io("sending the handshake reply", &e));
    verdict.map_err(|(_, e)| e)?;
    sent
}
