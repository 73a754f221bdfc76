//! One message per length-prefixed frame, over any async byte stream.

use specinfer_wire::{
    decode_frame, encode_frame, frame_len, DecodeError, Limits, Message, FRAME_HEADER_BYTES,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::NetError;

/// How long the rest of a frame may take once its first byte has arrived. Waiting *between*
/// frames is the caller's business (a chat's user may think for minutes); a frame that starts
/// and then trickles in would otherwise hold its buffer and its stream forever.
pub const FRAME_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads one frame; `Ok(None)` when the peer finished the stream cleanly between frames. The
/// length prefix is checked against the limits before anything is read into a buffer, the
/// buffer grows with the bytes that actually arrive (a length prefix alone allocates
/// nothing large), and the frame must be whole within [`FRAME_DEADLINE`] of its first byte.
pub async fn read_frame<R: AsyncRead + Unpin>(
    recv: &mut R,
    limits: &Limits,
) -> Result<Option<(Message, usize)>, NetError> {
    read_frame_within(recv, limits, FRAME_DEADLINE).await
}

/// [`read_frame`] with another deadline for the rest of a started frame.
pub async fn read_frame_within<R: AsyncRead + Unpin>(
    recv: &mut R,
    limits: &Limits,
    deadline: std::time::Duration,
) -> Result<Option<(Message, usize)>, NetError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    let first = recv.read(&mut header).await?;
    if first == 0 {
        return Ok(None);
    }
    let rest = async {
        let mut got = first;
        while got < FRAME_HEADER_BYTES {
            match recv.read(&mut header[got..]).await? {
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
        let mut body = Vec::with_capacity(len.min(64 << 10));
        (&mut *recv).take(len as u64).read_to_end(&mut body).await?;
        if body.len() < len {
            return Err(DecodeError::Truncated {
                got: body.len(),
                need: len,
            }
            .into());
        }
        Ok::<_, NetError>(Some((
            decode_frame(&body, limits)?,
            FRAME_HEADER_BYTES + len,
        )))
    };
    tokio::time::timeout(deadline, rest)
        .await
        .map_err(|_| NetError::Timeout)?
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

#[cfg(test)]
mod tests {
    use super::*;
    use specinfer_wire::{encode_frame, Message};
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn a_started_frame_must_finish_in_time_and_a_whole_one_is_read() {
        let limits = Limits::default();
        let msg = Message::Close { session: 7 };
        let frame = encode_frame(&msg);
        // Whole: read, whatever the deadline.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&frame).await.unwrap();
        let got = read_frame_within(&mut b, &limits, Duration::from_millis(200)).await;
        assert_eq!(got.unwrap().unwrap().0, msg);
        // A header announcing a 4 MiB body, then nothing: timed out, not waited on forever.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let mut header = frame[..FRAME_HEADER_BYTES].to_vec();
        header[..4].copy_from_slice(&((4u32 << 20) - 16).to_le_bytes());
        a.write_all(&header).await.unwrap();
        let slow = read_frame_within(&mut b, &limits, Duration::from_millis(200)).await;
        assert!(matches!(slow, Err(NetError::Timeout)), "{slow:?}");
        // Half a frame, then the stream ends: truncated.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&frame[..frame.len() - 1]).await.unwrap();
        drop(a);
        let cut = read_frame_within(&mut b, &limits, Duration::from_millis(200)).await;
        assert!(matches!(cut, Err(NetError::Decode(_))), "{cut:?}");
    }
}
