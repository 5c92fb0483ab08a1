package exporter

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
)

// testCAPEM is a self-signed CA certificate, PEM encoded.
func testCAPEM(t *testing.T) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

const upstreamToken = "eyJhbGciOiJFUzI1NiJ9.upstream-s3cr3t.sig"

// upstreamDoc is an ExporterConfig as upstream's reconciler writes it,
// with ca the base64 tls.ca and extra lines appended.
func upstreamDoc(ca string, extra ...string) string {
	return strings.Join(append([]string{
		"apiVersion: jumpstarter.dev/v1alpha1",
		"kind: ExporterConfig",
		"metadata: {name: pool-x7k2p, namespace: jumpstarter-lab}",
		"endpoint: grpc.jumpstarter.example:443",
		"tls: {ca: " + ca + "}",
		"token: " + upstreamToken,
		"export:",
		"  power: {type: jumpstarter_driver_power.driver.QemuPower}",
	}, extra...), "\n") + "\n"
}

// upstreamLayoutPod is an exporter pod in upstream's layout: the Secret
// mounted at /etc/jumpstarter/exporters, no annotation.
func upstreamLayoutPod() *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "jumpstarter-lab", Name: "pool-x7k2p", Labels: map[string]string{"jumpstarter.dev/board": "qemu"}},
		Spec: corev1.PodSpec{
			Volumes: []corev1.Volume{{Name: "exporter-config", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "exporter-config-pool-x7k2p"}}}},
			Containers: []corev1.Container{{Name: "vm", Image: "r/os:1",
				VolumeMounts: []corev1.VolumeMount{{Name: "exporter-config", MountPath: jsv1.ExporterConfigMountPath}}}},
		},
	}
}

func upstreamSecret(doc string, kv ...string) *corev1.Secret {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "jumpstarter-lab", Name: "exporter-config-pool-x7k2p"},
		Data: map[string][]byte{jsv1.ExporterConfigSecretKey: []byte(doc)}}
	for i := 0; i+1 < len(kv); i += 2 {
		s.Data[kv[i]] = []byte(kv[i+1])
	}
	return s
}

// TestSettingsUpstreamExporterConfig: a Secret holding upstream's
// config.yaml gives the exporter its endpoint, token, Exporter, CA
// (base64 decoded) and exitOnLeaseEnd; config.yaml wins over our keys in
// the same Secret; the guest login keys are still read; the pod's part
// (labels, hostname) is as for our layout.
func TestSettingsUpstreamExporterConfig(t *testing.T) {
	ca := testCAPEM(t)
	b64 := base64.StdEncoding.EncodeToString(ca)
	pod := upstreamLayoutPod()

	cfg, err := Settings(pod, upstreamSecret(upstreamDoc(b64, "exitOnLeaseEnd: true"),
		"endpoint", "ours.example:1", "token", "our-token", "namespace", "other", "name", "other", "username", "ci", "password", "pw-1"))
	require.NoError(t, err)
	assert.Equal(t, "grpc.jumpstarter.example:443", cfg.Endpoint, "config.yaml wins over our keys")
	assert.Equal(t, upstreamToken, cfg.Token)
	assert.Equal(t, "jumpstarter-lab", cfg.Namespace)
	assert.Equal(t, "pool-x7k2p", cfg.Name)
	assert.Equal(t, ca, cfg.CABundle, "tls.ca is the PEM bundle, base64 encoded")
	assert.True(t, cfg.ExitOnLeaseEnd)
	assert.Equal(t, "ci", cfg.Username)
	assert.Equal(t, "pw-1", cfg.Password)
	assert.Equal(t, map[string]string{"jumpstarter.dev/board": "qemu"}, cfg.Labels)
	assert.Equal(t, "pool-x7k2p", cfg.Hostname)

	// exitOnLeaseEnd false or absent (InPlaceReuse); an empty tls.ca (what
	// upstream writes without a CA ConfigMap) or no tls: the system roots;
	// the CA split over lines, as base64 tools print it.
	for name, doc := range map[string]string{
		"exitOnLeaseEnd false": upstreamDoc(b64, "exitOnLeaseEnd: false"),
		"empty tls.ca":         upstreamDoc(`""`),
		"no tls":               strings.Replace(upstreamDoc(""), "tls: {ca: }\n", "", 1),
		"CA over lines":        upstreamDoc(`"` + b64[:40] + `\n ` + b64[40:] + `"`),
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := Settings(pod, upstreamSecret(doc))
			require.NoError(t, err)
			assert.False(t, cfg.ExitOnLeaseEnd)
			assert.Equal(t, upstreamToken, cfg.Token)
			if name == "CA over lines" {
				assert.Equal(t, ca, cfg.CABundle)
			} else if name != "exitOnLeaseEnd false" {
				assert.Nil(t, cfg.CABundle, "the system roots")
			}
		})
	}
}

// TestSettingsUpstreamExporterConfigRefused: a malformed or hostile
// config.yaml is a ConfigError (the pod waits in
// CreateContainerConfigError, as for any bad exporter Secret) naming the
// Secret, the key and the field, and never the token.
func TestSettingsUpstreamExporterConfigRefused(t *testing.T) {
	b64 := base64.StdEncoding.EncodeToString(testCAPEM(t))
	drop := func(line string) string { return strings.Replace(upstreamDoc(b64), line+"\n", "", 1) }
	for name, tc := range map[string]struct{ doc, want string }{
		"not YAML":               {"metadata: [\ntoken: " + upstreamToken + "\n", "decode ExporterConfig"},
		"a list":                 {"- " + upstreamToken + "\n", "decode ExporterConfig"},
		"token not a string":     {drop("token: "+upstreamToken) + "token: {a: " + upstreamToken + "}\n", "decode ExporterConfig"},
		"the token as the kind":  {strings.Replace(upstreamDoc(b64), "kind: ExporterConfig", "kind: "+upstreamToken, 1), `kind "<token>"`},
		"wrong kind":             {strings.Replace(upstreamDoc(b64), "kind: ExporterConfig", "kind: ClientConfig", 1), `kind "ClientConfig"`},
		"no metadata.name":       {strings.Replace(upstreamDoc(b64), "name: pool-x7k2p, ", "", 1), "metadata.name is empty"},
		"no metadata.namespace":  {strings.Replace(upstreamDoc(b64), ", namespace: jumpstarter-lab", "", 1), "metadata.namespace is missing or empty"},
		"no endpoint":            {drop("endpoint: grpc.jumpstarter.example:443"), "endpoint is missing or empty"},
		"endpoint with a scheme": {strings.Replace(upstreamDoc(b64), "endpoint: grpc", "endpoint: grpcs://grpc", 1), "endpoint: "},
		"no token":               {drop("token: " + upstreamToken), "token is missing or empty"},
		"token with a space":     {strings.Replace(upstreamDoc(b64), "token: eyJ", "token: bad eyJ", 1), "token: white space inside the token"},
		"tls.insecure":           {strings.Replace(upstreamDoc(b64), "tls: {ca: "+b64+"}", "tls: {ca: "+b64+", insecure: true}", 1), "tls.insecure: true is refused"},
		"tls.ca not base64":      {upstreamDoc("not*base64"), "tls.ca: not base64"},
		"tls.ca raw PEM":         {upstreamDoc(`"-----BEGIN CERTIFICATE-----"`), "tls.ca: not base64"},
		"tls.ca no certificate":  {upstreamDoc(base64.StdEncoding.EncodeToString([]byte("hello"))), "tls.ca: holds no PEM certificate"},
		"bad driver tree":        {upstreamDoc(b64, "  console: {type: X, ref: power}"), "export.console: type and ref are mutually exclusive"},
		"alias bomb":             {aliasBomb(), "excessive aliasing"},
	} {
		t.Run(name, func(t *testing.T) {
			pod := upstreamLayoutPod()
			_, err := Settings(pod, upstreamSecret(tc.doc))
			require.Error(t, err)
			assert.True(t, podspec.IsConfigError(err), "a config error (the pod waits): %v", err)
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), `secret "exporter-config-pool-x7k2p" (volume "exporter-config" mounted at /etc/jumpstarter/exporters`)
			assert.Contains(t, err.Error(), `key "config.yaml"`)
			assert.NotContains(t, err.Error(), "upstream-s3cr3t", "the token never shows")

			// CheckConfig, which holds the VM's start, gives the same error.
			cerr := CheckConfig(context.Background(), func(context.Context, string, string) (*corev1.Secret, error) {
				return upstreamSecret(tc.doc), nil
			}, pod)
			require.Error(t, cerr)
			assert.True(t, podspec.IsConfigError(cerr))
			assert.Equal(t, err.Error(), cerr.Error())
		})
	}
}

// aliasBomb is a YAML document of a few hundred bytes whose aliases expand
// to 10^9 strings (a "billion laughs"): the decoder must refuse it rather
// than expand it.
func aliasBomb() string {
	var b strings.Builder
	b.WriteString("a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n")
	prev := "a"
	for _, n := range []string{"b", "c", "d", "e", "f", "g", "h", "i"} {
		fmt.Fprintf(&b, "%s: &%s [*%s,*%s,*%s,*%s,*%s,*%s,*%s,*%s,*%s,*%s]\n", n, n, prev, prev, prev, prev, prev, prev, prev, prev, prev, prev)
		prev = n
	}
	b.WriteString("token: " + upstreamToken + "\n")
	return b.String()
}
