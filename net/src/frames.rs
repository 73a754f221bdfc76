//! One message per length-prefixed frame, over any async byte stream.

use specinfer_wire::{
    decode_frame, encode_frame, frame_len, DecodeError, Limits, Message, FRAME_HEADER_BYTES,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::NetError;

/// Reads one frame; `Ok(None)` when the peer finished the stream cleanly between frames. The
/// length prefix is checked against the limits before the body buffer is allocated.
pub async fn read_frame<R: AsyncRead + Unpin>(
    recv: &mut R,
    limits: &Limits,
) -> Result<Option<(Message, usize)>, NetError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    let mut got = 0;
    while got < FRAME_HEADER_BYTES {
        match recv.read(&mut header[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => {
                return Err(DecodeError::Truncated {
                    got,
                    need: FRAME_HEADER_BYTES,
                }
                .into())
            }
            n => got += n,
        }
    }
    let len = frame_len(header, limits)?;
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await?;
    Ok(Some((
        decode_frame(&body, limits)?,
        FRAME_HEADER_BYTES + len,
    )))
}

/// Writes one frame; returns its size in bytes.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    send: &mut W,
    msg: &Message,
) -> Result<usize, NetError> {
    let frame = encode_frame(msg);
    send.write_all(&frame).await?;
    Ok(frame.len())
}
