package exporter

import (
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"unicode"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// The exporter Secret comes in two layouts:
//   - upstream Jumpstarter's: one key, config.yaml (jsv1.ExporterConfigSecretKey),
//     an ExporterConfig as upstream's ExporterSet reconciler writes it and
//     its exporter reads it from /etc/jumpstarter/exporters: endpoint,
//     token, metadata.name and metadata.namespace (required), tls.ca (a
//     base64 encoded PEM bundle; empty: the system roots) and
//     exitOnLeaseEnd. tls.insecure: true (upstream's exporter then trusts any
//     certificate) is refused: the node's exporter always verifies the
//     controller's and the router's certificates. The driver tree (export)
//     is checked as upstream's reader would and otherwise not read here:
//     the pod defines the VM and its drivers;
//   - ours: the keys endpoint, token, namespace, name and ca.crt
//     (api/v1alpha1 JumpstarterSecret*).
// A Secret holding config.yaml is read as upstream's, whatever other keys
// it holds (the guest login keys username and password are read from it
// in both layouts: podspec.GuestLoginFromSecret).

// exitedOnLeaseEnd is the exporter condition's message once the exporter
// ended at its lease's end (ExporterConfig exitOnLeaseEnd: true).
const exitedOnLeaseEnd = "the lease ended and the exporter config says exitOnLeaseEnd: the exporter stays offline until the pod is replaced (its ExporterSet does that; delete a pod no set manages)"

// secretValue is key's value in secret (Data, else StringData) and
// whether it is there at all.
func secretValue(secret *corev1.Secret, key string) ([]byte, bool) {
	if b, ok := secret.Data[key]; ok {
		return b, true
	}
	v, ok := secret.StringData[key]
	return []byte(v), ok
}

// credentials reads the exporter's controller settings (endpoint, token,
// Exporter namespace and name, CA, exitOnLeaseEnd) from its Secret in
// either layout; where names the Secret in errors. A missing or bad value
// is a ConfigError naming the key or field, never the token. Pure.
func credentials(secret *corev1.Secret, where string) (jumpstarter.Config, error) {
	if raw, ok := secretValue(secret, jsv1.ExporterConfigSecretKey); ok {
		return upstreamCredentials(raw, where)
	}
	return ourCredentials(secret, where)
}

// ourCredentials reads our keys.
func ourCredentials(secret *corev1.Secret, where string) (jumpstarter.Config, error) {
	get := func(key string) (string, error) {
		v := strings.TrimSpace(string(secret.Data[key]))
		if v == "" {
			v = strings.TrimSpace(secret.StringData[key])
		}
		if v == "" {
			return "", &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q is missing or empty", where, key)}
		}
		return v, nil
	}
	var cfg jumpstarter.Config
	var err error
	if cfg.Endpoint, err = get(v1alpha1.JumpstarterSecretEndpoint); err != nil {
		return cfg, err
	}
	if err := validateEndpoint(cfg.Endpoint); err != nil {
		return cfg, &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q: %v", where, v1alpha1.JumpstarterSecretEndpoint, err)}
	}
	if cfg.Token, err = get(v1alpha1.JumpstarterSecretToken); err != nil {
		return cfg, err
	}
	if strings.ContainsAny(cfg.Token, " \t\r\n") {
		return cfg, &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q holds white space inside the token", where, v1alpha1.JumpstarterSecretToken)}
	}
	if cfg.Namespace, err = get(v1alpha1.JumpstarterSecretNamespace); err != nil {
		return cfg, err
	}
	if cfg.Name, err = get(v1alpha1.JumpstarterSecretName); err != nil {
		return cfg, err
	}
	if ca := secret.Data[v1alpha1.JumpstarterSecretCA]; len(ca) > 0 {
		if !x509.NewCertPool().AppendCertsFromPEM(ca) {
			return cfg, &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q holds no PEM certificate", where, v1alpha1.JumpstarterSecretCA)}
		}
		cfg.CABundle = append([]byte(nil), ca...)
	}
	return cfg, nil
}

// upstreamCredentials reads upstream's ExporterConfig document raw.
func upstreamCredentials(raw []byte, where string) (jumpstarter.Config, error) {
	var cfg jumpstarter.Config
	bad := func(format string, a ...any) error {
		msg := fmt.Sprintf("%s: key %q: ", where, jsv1.ExporterConfigSecretKey) + fmt.Sprintf(format, a...)
		return &podspec.ConfigError{Msg: redact(msg, rawToken(raw))}
	}
	c, err := jsv1.ParseExporterConfig(raw)
	if err != nil {
		return cfg, bad("%v", err)
	}
	var errs []error
	field := func(name, v string) string {
		v = strings.TrimSpace(v)
		if v == "" {
			errs = append(errs, fmt.Errorf("%s is missing or empty", name))
		}
		return v
	}
	cfg.Endpoint = field("endpoint", c.Endpoint)
	if cfg.Endpoint != "" {
		if err := validateEndpoint(cfg.Endpoint); err != nil {
			errs = append(errs, fmt.Errorf("endpoint: %w", err))
		}
	}
	cfg.Token = field("token", c.Token)
	if strings.IndexFunc(cfg.Token, unicode.IsSpace) >= 0 {
		errs = append(errs, errors.New("token: white space inside the token"))
	}
	cfg.Name = field("metadata.name", c.Metadata.Name)
	cfg.Namespace = field("metadata.namespace", c.Metadata.Namespace)
	if c.TLS != nil {
		if c.TLS.Insecure {
			errs = append(errs, errors.New("tls.insecure: true is refused: the node's exporter always verifies the controller's and the router's certificates; put their CA, base64 encoded PEM, in tls.ca"))
		}
		if ca, err := decodeCA(c.TLS.CA); err != nil {
			errs = append(errs, fmt.Errorf("tls.ca: %w", err))
		} else {
			cfg.CABundle = ca
		}
	}
	if err := errors.Join(errs...); err != nil {
		return jumpstarter.Config{}, bad("%s", strings.ReplaceAll(err.Error(), "\n", "; "))
	}
	cfg.ExitOnLeaseEnd = c.ExitOnLeaseEnd
	return cfg, nil
}

// decodeCA decodes tls.ca: base64 (white space ignored) of a PEM bundle;
// nil for an empty one (the system roots).
func decodeCA(b64 string) ([]byte, error) {
	b64 = strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) {
			return -1
		}
		return r
	}, b64)
	if b64 == "" {
		return nil, nil
	}
	pem, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return nil, fmt.Errorf("not base64 (upstream's layout holds the PEM bundle base64 encoded): %v", err)
	}
	if !x509.NewCertPool().AppendCertsFromPEM(pem) {
		return nil, errors.New("holds no PEM certificate once base64 decoded")
	}
	return pem, nil
}

// rawToken is the token of a document that may not parse as an
// ExporterConfig, so that errors never quote it ("": none found, or too
// short to be a credential and to be told from other words).
func rawToken(raw []byte) string {
	var doc struct {
		Token any `json:"token"`
	}
	if yaml.Unmarshal(raw, &doc) != nil {
		return ""
	}
	if s, ok := doc.Token.(string); ok && len(strings.TrimSpace(s)) >= 8 {
		return strings.TrimSpace(s)
	}
	return ""
}
