package oci

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/platforms"
	"github.com/go-logr/logr"
)

// Options configure a Store. The zero value is usable.
type Options struct {
	// Registries holds per-registry settings keyed by host[:port] as it
	// appears in references ("docker.io", "127.0.0.1:5000").
	Registries map[string]RegistryConfig
	// DialTimeout bounds TCP connects (default 10s).
	DialTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait for response headers (default 30s).
	ResponseHeaderTimeout time.Duration
	// StallTimeout aborts a pull when no byte arrived for this long (default 2m).
	StallTimeout time.Duration
	// Limits (defaults in DefaultLimits).
	Limits Limits
	// Platform to select from multi-arch indexes (default: the host's,
	// from containerd/platforms).
	Platform string
	// Concurrency is the number of blobs fetched in parallel (default 4).
	Concurrency int
	// Logger receives structured logs (default: discard). Pass
	// klog.Background() or any logr implementation.
	Logger logr.Logger
}

// Limits bound what a pull may write; exceeding one fails with ErrTooLarge.
type Limits struct {
	MaxManifestBytes int64 // manifests, indexes, configs (default 4 MiB)
	MaxBlobBytes     int64 // one layer as downloaded (default 64 GiB)
	MaxFileBytes     int64 // one unpacked file: disk after decompression (default 256 GiB)
	MaxSmallBytes    int64 // kernel, initrd, cmdline (default 1 GiB)
}

// DefaultLimits are used for zero fields of Options.Limits.
var DefaultLimits = Limits{
	MaxManifestBytes: 4 << 20,
	MaxBlobBytes:     64 << 30,
	MaxFileBytes:     256 << 30,
	MaxSmallBytes:    1 << 30,
}

// RegistryConfig is the setting for one registry host.
type RegistryConfig struct {
	// PlainHTTP talks http:// instead of https://. Loopback registries
	// (localhost, 127.0.0.0/8, ::1) use plain HTTP by default.
	PlainHTTP bool
	// InsecureSkipVerify disables TLS certificate verification.
	InsecureSkipVerify bool
	// Mirrors are tried in order before the registry itself, for pulls and
	// tag resolution. Each is "host[:port]" or a URL "http://host:port[/prefix]".
	Mirrors []string
}

func (o Options) withDefaults() Options {
	if o.DialTimeout == 0 {
		o.DialTimeout = 10 * time.Second
	}
	if o.ResponseHeaderTimeout == 0 {
		o.ResponseHeaderTimeout = 30 * time.Second
	}
	if o.StallTimeout == 0 {
		o.StallTimeout = 2 * time.Minute
	}
	if o.Logger.GetSink() == nil {
		o.Logger = logr.Discard()
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 4
	}
	if o.Platform == "" {
		o.Platform = platforms.Format(platforms.DefaultSpec())
	}
	d := DefaultLimits
	if o.Limits.MaxManifestBytes == 0 {
		o.Limits.MaxManifestBytes = d.MaxManifestBytes
	}
	if o.Limits.MaxBlobBytes == 0 {
		o.Limits.MaxBlobBytes = d.MaxBlobBytes
	}
	if o.Limits.MaxFileBytes == 0 {
		o.Limits.MaxFileBytes = d.MaxFileBytes
	}
	if o.Limits.MaxSmallBytes == 0 {
		o.Limits.MaxSmallBytes = d.MaxSmallBytes
	}
	return o
}

// clients holds the HTTP clients of a Store, shared by all pulls so that
// connections are reused.
type clients struct {
	secure, insecure *http.Client
}

func (c clients) get(insecure bool) *http.Client {
	if insecure {
		return c.insecure
	}
	return c.secure
}

func (o Options) newClients() clients {
	d := &net.Dialer{Timeout: o.DialTimeout, KeepAlive: 30 * time.Second}
	return clients{secure: o.httpClient(d, false), insecure: o.httpClient(d, true)}
}

// dialClients are the clients of one pull with its own Dialer
// (PullOptions.Dial): their connections are the pull's alone.
func (o Options) dialClients(d Dialer) clients {
	return clients{secure: o.httpClient(d, false), insecure: o.httpClient(d, true)}
}

func (c clients) closeIdle() {
	c.secure.CloseIdleConnections()
	c.insecure.CloseIdleConnections()
}

func (o Options) httpClient(d Dialer, insecure bool) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	dial := d.DialContext
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		ctx, cancel := context.WithTimeout(ctx, o.DialTimeout)
		defer cancel()
		return dial(ctx, network, addr)
	}
	tr.ResponseHeaderTimeout = o.ResponseHeaderTimeout
	tr.TLSHandshakeTimeout = o.DialTimeout
	tr.Proxy = nil
	if insecure {
		tr.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // explicit per-registry opt-in
	}
	return &http.Client{Transport: tr}
}

// registryHosts builds the containerd Hosts function: mirrors first, then the
// registry itself, each with the credentials from auth. The node's
// configured mirrors use the clients c (the node's settings chose them),
// the reference's own registry (and the token service it names) own.
func (o Options) registryHosts(c, own clients, auth *dockerConfig) docker.RegistryHosts {
	authorizer := docker.NewDockerAuthorizer(
		docker.WithAuthClient(own.secure),
		docker.WithAuthCreds(auth.credentials),
	)
	mirrorAuthorizer := authorizer
	if own != c {
		mirrorAuthorizer = docker.NewDockerAuthorizer(docker.WithAuthClient(c.secure), docker.WithAuthCreds(auth.credentials))
	}
	return func(host string) ([]docker.RegistryHost, error) {
		cfg := o.Registries[host]
		var hosts []docker.RegistryHost
		for _, m := range cfg.Mirrors {
			h, err := o.mirrorHost(c, m, mirrorAuthorizer)
			if err != nil {
				return nil, fmt.Errorf("registry %s: %w", host, err)
			}
			hosts = append(hosts, h)
		}
		scheme := "https"
		if cfg.PlainHTTP || docker.IsLocalhost(host) {
			scheme = "http"
		}
		apiHost := host
		if host == "docker.io" {
			apiHost = "registry-1.docker.io"
		}
		hosts = append(hosts, docker.RegistryHost{
			Client:       own.get(cfg.InsecureSkipVerify),
			Authorizer:   authorizer,
			Host:         apiHost,
			Scheme:       scheme,
			Path:         "/v2",
			Capabilities: docker.HostCapabilityPull | docker.HostCapabilityResolve,
		})
		return hosts, nil
	}
}

func (o Options) mirrorHost(c clients, m string, authorizer docker.Authorizer) (docker.RegistryHost, error) {
	if !strings.Contains(m, "://") {
		scheme := "https"
		if mc, ok := o.Registries[m]; (ok && mc.PlainHTTP) || docker.IsLocalhost(m) {
			scheme = "http"
		}
		m = scheme + "://" + m
	}
	u, err := url.Parse(m)
	if err != nil || u.Host == "" {
		return docker.RegistryHost{}, fmt.Errorf("mirror %q: not host[:port] or URL", m)
	}
	p := strings.TrimSuffix(u.Path, "/")
	if !strings.HasSuffix(p, "/v2") {
		p += "/v2"
	}
	return docker.RegistryHost{
		Client:       c.get(o.Registries[u.Host].InsecureSkipVerify),
		Authorizer:   authorizer,
		Host:         u.Host,
		Scheme:       u.Scheme,
		Path:         p,
		Capabilities: docker.HostCapabilityPull | docker.HostCapabilityResolve,
	}, nil
}

// dockerConfig is the part of a Docker config JSON (~/.docker/config.json,
// the .dockerconfigjson key of a kubernetes.io/dockerconfigjson secret) that
// carries registry credentials. The legacy .dockercfg form (the auths map
// without the "auths" wrapper) is accepted too.
type dockerConfig struct {
	Auths map[string]dockerAuth `json:"auths"`
}

type dockerAuth struct {
	Auth          string `json:"auth"`
	Username      string `json:"username"`
	Password      string `json:"password"`
	IdentityToken string `json:"identitytoken"`
}

// parseDockerConfig parses Docker config JSON documents; later documents win
// for the same registry.
func parseDockerConfig(docs ...[]byte) (*dockerConfig, error) {
	out := &dockerConfig{Auths: map[string]dockerAuth{}}
	for i, doc := range docs {
		if len(doc) == 0 {
			continue
		}
		var c dockerConfig
		if err := json.Unmarshal(doc, &c); err != nil {
			return nil, fmt.Errorf("pull secret %d: not Docker config JSON: %w", i, err)
		}
		if c.Auths == nil { // legacy .dockercfg: the map itself
			if err := json.Unmarshal(doc, &c.Auths); err != nil {
				return nil, fmt.Errorf("pull secret %d: no \"auths\": %w", i, err)
			}
		}
		for k, a := range c.Auths {
			if a.Auth != "" && a.Username == "" {
				raw, err := base64.StdEncoding.DecodeString(a.Auth)
				if err != nil {
					return nil, fmt.Errorf("pull secret %d: registry %s: auth is not base64: %w", i, k, err)
				}
				user, pass, ok := strings.Cut(string(raw), ":")
				if !ok {
					return nil, fmt.Errorf("pull secret %d: registry %s: auth is not user:password", i, k)
				}
				a.Username, a.Password = user, pass
			}
			out.Auths[normalizeAuthKey(k)] = a
		}
	}
	return out, nil
}

// normalizeAuthKey turns "https://index.docker.io/v1/" or "http://host:5000"
// into a host[:port].
func normalizeAuthKey(k string) string {
	k = strings.TrimSpace(k)
	if i := strings.Index(k, "://"); i >= 0 {
		k = k[i+3:]
	}
	if i := strings.IndexByte(k, '/'); i >= 0 {
		k = k[:i]
	}
	switch k {
	case "index.docker.io", "registry-1.docker.io", "docker.io":
		return "docker.io"
	}
	return k
}

// credentials is the docker.WithAuthCreds callback.
func (c *dockerConfig) credentials(host string) (string, string, error) {
	if c == nil {
		return "", "", nil
	}
	a, ok := c.Auths[normalizeAuthKey(host)]
	if !ok {
		return "", "", nil
	}
	if a.IdentityToken != "" {
		return "", a.IdentityToken, nil
	}
	return a.Username, a.Password, nil
}
