package streamconn

import (
	"encoding/binary"
	"io"
	"math/bits"
	"sync"

	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the "proto" codec Codec falls back to
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// BufferPool is the gRPC buffer pool of every connection that carries
// router streams (experimental.BufferPool, experimental.WithBufferPool),
// and where Codec puts received payloads. Its tiers are powers of two
// from 256 B to 4 MiB, so the 64 KiB frames upstream's Python clients send
// (a file read in 64 KiB chunks) and larger messages each take a buffer
// near their size, instead of gRPC's default jump from 32 KiB to 1 MiB.
// Buffers are not cleared when reused: gRPC fills every buffer it gets
// (the bytes read off the wire) before anyone reads it, and so does Codec.
var BufferPool mem.BufferPool = newTieredPool(8, 22)

// tieredPool is a mem.BufferPool of power-of-two tiers; a buffer larger
// than the largest tier is allocated and dropped.
type tieredPool struct {
	minShift, maxShift int
	tiers              []sync.Pool // tiers[i] holds *[]byte of cap 1<<(minShift+i)
}

func newTieredPool(minShift, maxShift int) *tieredPool {
	return &tieredPool{minShift: minShift, maxShift: maxShift, tiers: make([]sync.Pool, maxShift-minShift+1)}
}

// tier is the index of the smallest tier holding n bytes (-1: none).
func (p *tieredPool) tier(n int) int {
	s := max(bits.Len(uint(n-1)), p.minShift)
	if n <= 0 {
		s = p.minShift
	}
	if s > p.maxShift {
		return -1
	}
	return s - p.minShift
}

func (p *tieredPool) Get(n int) *[]byte {
	i := p.tier(n)
	if i < 0 {
		b := make([]byte, n)
		return &b
	}
	if bp, ok := p.tiers[i].Get().(*[]byte); ok {
		*bp = (*bp)[:n]
		return bp
	}
	b := make([]byte, n, 1<<(p.minShift+i))
	return &b
}

func (p *tieredPool) Put(bp *[]byte) {
	c := cap(*bp)
	i := p.tier(c)
	if i < 0 || 1<<(p.minShift+i) != c {
		return // not one of ours
	}
	*bp = (*bp)[:0]
	p.tiers[i].Put(bp)
}

// Pooled marks f's payloads as BufferPool buffers (f is a stream of a
// connection using Codec): Conn returns each to the pool once it has read
// it. Nothing else may keep a payload Pooled frames return.
func Pooled(f Frames) Frames { return pooledFrames{f} }

type pooledFrames struct{ Frames }

func (pooledFrames) release(p []byte) {
	if cap(p) > 0 {
		p = p[:0]
		BufferPool.Put(&p)
	}
}

// Codec is gRPC's proto codec with a fast path for the router's frames
// (StreamRequest, StreamResponse). A frame sent is encoded into a
// BufferPool buffer. A frame received has its payload copied once, straight
// from the received buffers into a BufferPool buffer that Conn returns to
// the pool when it has read it, instead of being joined into one buffer
// and then copied again into a new allocation per frame. Anything else,
// and a frame in any but the plain encoding (unknown fields, a repeated
// field), takes the proto codec's path. Use it (grpc.ForceServerCodecV2,
// grpc.ForceCodecV2) on connections whose router streams are read through
// Conns over Pooled frames, which return the payloads to the pool (those
// of any other reader are left to the garbage collector).
var Codec encoding.CodecV2 = frameCodec{base: encoding.GetCodecV2("proto")}

type frameCodec struct{ base encoding.CodecV2 }

func (c frameCodec) Name() string { return c.base.Name() }

func (c frameCodec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *pb.StreamRequest:
		if len(m.ProtoReflect().GetUnknown()) == 0 {
			if b, ok := encodeFrame(m.GetPayload(), m.GetFrameType()); ok {
				return b, nil
			}
		}
	case *pb.StreamResponse:
		if len(m.ProtoReflect().GetUnknown()) == 0 {
			if b, ok := encodeFrame(m.GetPayload(), m.GetFrameType()); ok {
				return b, nil
			}
		}
	}
	return c.base.Marshal(v)
}

// encodeFrame writes a frame as proto does (fields in order, zero values
// left out) into a BufferPool buffer; small frames (ok false) are left to
// the proto codec, which does not pool them either. gRPC's proto codec
// takes large messages' buffers from its default pool, whose tiers jump
// from 32 KiB to a megabyte that it clears for each 64 KiB frame.
func encodeFrame(payload []byte, ft pb.FrameType) (mem.BufferSlice, bool) {
	size := 0
	if len(payload) > 0 {
		size += 1 + protowire.SizeVarint(uint64(len(payload))) + len(payload)
	}
	if ft != 0 {
		size += 1 + protowire.SizeVarint(uint64(int64(ft)))
	}
	if mem.IsBelowBufferPoolingThreshold(size) {
		return nil, false
	}
	bp := BufferPool.Get(size)
	b := (*bp)[:0]
	if len(payload) > 0 {
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendBytes(b, payload)
	}
	if ft != 0 {
		b = protowire.AppendTag(b, 2, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(int64(ft)))
	}
	*bp = b
	return mem.BufferSlice{mem.NewBuffer(bp, BufferPool)}, true
}

func (c frameCodec) Unmarshal(data mem.BufferSlice, v any) error {
	switch m := v.(type) {
	case *pb.StreamRequest:
		if p, ft, ok := decodeFrame(data); ok {
			m.Reset()
			m.Payload, m.FrameType = p, ft
			return nil
		}
	case *pb.StreamResponse:
		if p, ft, ok := decodeFrame(data); ok {
			m.Reset()
			m.Payload, m.FrameType = p, ft
			return nil
		}
	}
	return c.base.Unmarshal(data, v)
}

// Frame fields on the wire: payload (1, bytes), frame_type (2, varint).
const (
	payloadTag   = 1<<3 | 2
	frameTypeTag = 2<<3 | 0
)

// decodeFrame parses a frame whose fields are each present at most once
// and nothing else; ok false leaves the parse to the proto codec.
func decodeFrame(data mem.BufferSlice) (payload []byte, ft pb.FrameType, ok bool) {
	r := data.Reader()
	defer r.Close()
	var bp *[]byte
	fail := func() ([]byte, pb.FrameType, bool) {
		if bp != nil {
			BufferPool.Put(bp)
		}
		return nil, 0, false
	}
	seenFT := false
	for r.Remaining() > 0 {
		tag, err := binary.ReadUvarint(r)
		if err != nil {
			return fail()
		}
		switch {
		case tag == payloadTag && bp == nil:
			n, err := binary.ReadUvarint(r)
			if err != nil || n > uint64(r.Remaining()) {
				return fail()
			}
			bp = BufferPool.Get(int(n))
			if _, err := io.ReadFull(r, *bp); err != nil {
				return fail()
			}
		case tag == frameTypeTag && !seenFT:
			v, err := binary.ReadUvarint(r)
			if err != nil || v > 1<<31-1 {
				return fail()
			}
			ft, seenFT = pb.FrameType(v), true
		default:
			return fail()
		}
	}
	if bp == nil {
		return nil, ft, true
	}
	return *bp, ft, true
}
