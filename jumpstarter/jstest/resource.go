package jstest

import (
	"compress/bzip2"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
	"google.golang.org/grpc/metadata"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/internal/streamconn"
)

// Resource is an open resource stream (upstream's DriverClient.resource_async).
type Resource struct {
	// Handle is the `resource` the exporter answered, as the client passes
	// it to a call (a client_stream object).
	Handle map[string]any
	// AcceptEncoding is the exporter's x_jmp_accept_encoding ("" when it
	// did not accept the encoding asked for: the client then decodes on
	// upload and encodes on download itself).
	AcceptEncoding string
	// Conn carries the bytes both ways (CloseWrite sends GOAWAY).
	Conn *streamconn.Conn
	// Abort ends the stream without GOAWAY, as a client that dies or is
	// interrupted mid-transfer (the exporter sees the stream cancelled).
	Abort context.CancelFunc
}

// OpenResource opens RouterService.Stream with request {"kind":"resource",
// "uuid":driver,"x_jmp_content_encoding":encoding|null} and reads the
// handle from the initial metadata. ctx bounds the opening only.
func (s *Session) OpenResource(ctx context.Context, driver, encoding string) (*Resource, error) {
	req := map[string]any{"kind": "resource", "uuid": driver, "x_jmp_content_encoding": nil}
	if encoding != "" {
		req["x_jmp_content_encoding"] = encoding
	}
	b, _ := json.Marshal(req)
	sctx, cancel := context.WithCancel(context.Background())
	sctx = metadata.AppendToOutgoingContext(sctx, "request", string(b))
	stop := context.AfterFunc(ctx, cancel)
	st, err := s.Router.Stream(sctx)
	var md metadata.MD
	if err == nil {
		md, err = st.Header()
		if err == nil && md == nil {
			if _, err = st.Recv(); errors.Is(err, io.EOF) || err == nil {
				err = errors.New("the exporter ended the resource stream without headers")
			}
		}
	}
	stop()
	if err != nil {
		cancel()
		return nil, err
	}
	r := &Resource{Conn: streamconn.New(streamconn.ClientFrames(st), cancel, "resource:"+driver), Abort: cancel}
	vals := md.Get("resource")
	if len(vals) != 1 {
		r.Conn.Close()
		return nil, fmt.Errorf("resource stream: %d `resource` metadata entries, want 1", len(vals))
	}
	if err := json.Unmarshal([]byte(vals[0]), &r.Handle); err != nil {
		r.Conn.Close()
		return nil, fmt.Errorf("resource stream: `resource` metadata is not JSON: %v", err)
	}
	if v := md.Get("x_jmp_accept_encoding"); len(v) == 1 {
		r.AcceptEncoding = v[0]
	}
	return r, nil
}

// Flash is FlasherClient.flash with a local file: src goes up a resource
// stream (content encoding compression, "" for none; a compression the
// exporter does not accept is decoded here first, as upstream's client
// does) while flash(handle, partition) runs; both must succeed.
func (s *Session) Flash(ctx context.Context, flasher string, src io.Reader, partition any, compression string) error {
	r, err := s.OpenResource(ctx, flasher, compression)
	if err != nil {
		return fmt.Errorf("open resource: %w", err)
	}
	defer r.Conn.Close()
	if compression != "" && r.AcceptEncoding == "" {
		if src, err = Decode(compression, src); err != nil {
			return err
		}
	}
	sent := make(chan error, 1)
	go func() {
		// The file in frames of 64 KiB, as upstream's client reads it
		// (client/flasher.py: f.read(65536)).
		r.Conn.SetMaxFrame(ClientFrame)
		_, err := io.CopyBuffer(r.Conn, struct{ io.Reader }{src}, make([]byte, ClientFrame))
		if err == nil {
			err = r.Conn.CloseWrite() // GOAWAY: the end of the bytes
		}
		sent <- err
	}()
	go func() { _, _ = io.Copy(io.Discard, r.Conn) }() // the exporter sends nothing
	_, callErr := s.Call(ctx, flasher, "flash", r.Handle, partition)
	if callErr != nil {
		r.Conn.Close()
		<-sent
		return callErr
	}
	if err := <-sent; err != nil {
		return fmt.Errorf("send the image: %w", err)
	}
	return nil
}

// Dump is FlasherClient.dump into dst: dump(handle, partition) writes the
// partition down a resource stream (encoded in compression, "" for none;
// one the exporter does not accept is encoded here). It returns once the
// call succeeded and every byte arrived.
func (s *Session) Dump(ctx context.Context, flasher string, dst io.Writer, partition any, compression string) error {
	r, err := s.OpenResource(ctx, flasher, compression)
	if err != nil {
		return fmt.Errorf("open resource: %w", err)
	}
	defer r.Conn.Close()
	_ = r.Conn.CloseWrite() // the client sends nothing
	var enc io.WriteCloser
	if compression != "" && r.AcceptEncoding == "" {
		if enc, err = Encode(compression, dst); err != nil {
			return err
		}
		dst = enc
	}
	got := make(chan error, 1)
	go func() {
		_, err := io.Copy(dst, r.Conn)
		if err == nil && enc != nil {
			err = enc.Close()
		}
		got <- err
	}()
	if _, err := s.Call(ctx, flasher, "dump", r.Handle, partition); err != nil {
		r.Conn.Close()
		<-got
		return err
	}
	if err := <-got; err != nil {
		return fmt.Errorf("receive the dump: %w", err)
	}
	return nil
}

// Decode decodes a stream in one of upstream's Compression encodings.
func Decode(enc string, r io.Reader) (io.Reader, error) {
	switch enc {
	case "gzip":
		return gzip.NewReader(r)
	case "xz":
		return xz.NewReader(r)
	case "bz2":
		return bzip2.NewReader(r), nil
	case "zstd":
		return zstd.NewReader(r)
	}
	return nil, fmt.Errorf("compression %q: want gzip, xz, bz2 or zstd", enc)
}

// Encode encodes into w in gzip, xz or zstd (bz2 has no Go encoder).
func Encode(enc string, w io.Writer) (io.WriteCloser, error) {
	switch enc {
	case "gzip":
		return gzip.NewWriter(w), nil
	case "xz":
		return xz.NewWriter(w)
	case "zstd":
		return zstd.NewWriter(w)
	}
	return nil, fmt.Errorf("compression %q: this client encodes gzip, xz or zstd", enc)
}
